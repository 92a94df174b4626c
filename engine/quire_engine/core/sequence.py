"""One generation stream: its tokens, its progress and where it sits in the scheduler.

A ``Sequence`` is plain data. The scheduler owns its ``status``, ``num_computed_tokens`` and
``num_cached_tokens``; the engine appends sampled tokens through ``Scheduler.update``; the KV
cache manager owns its block table (kept outside, keyed by ``seq_id``) and fills
``block_hashes`` lazily.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

_arrival_counter = itertools.count()


class FinishReason(enum.StrEnum):
    """Why a sample ended; the values are the OpenAI wire strings (``finish_reason``)."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away, the server shut down, or the request failed


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not (or no longer) holding blocks; prefill pending
    RUNNING = "running"  # holds blocks in the device pool
    SWAPPED = "swapped"  # its blocks live in the CPU pool
    FINISHED = "finished"  # done (stopped, length, aborted, rejected); holds nothing


@dataclass(eq=False, slots=True)
class Sequence:
    """Token ids plus scheduling state.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. Tokens past it (the rest of
    the prompt, or the token sampled in the previous step) are computed by the next steps.
    ``max_tokens`` bounds generation and is what the scheduler uses to reject a request that could
    never fit in the pool. ``cache_salt`` isolates prefix-cache entries between tenants.
    """

    seq_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    # The LoRA adapter (``core/lora``: its lora_int_id; 0 the base model) and its directory, both
    # part of the block hash: an id reused for another adapter after an unload never meets the
    # blocks the first one left in the prefix cache.
    lora_id: int = 0
    lora_path: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the scheduler first took the sequence (-1:
    # not yet); set once, so a re-prefill after a preemption does not count as a lookup again.
    num_cached_tokens: int = -1
    # Prefix-cache hashes of the sequence's full blocks, in order; extended lazily.
    block_hashes: list[bytes] = field(default_factory=list)
    # Tie-breaker for "newest": forks inherit their parent's arrival and get a later sub-order.
    arrival: int = field(default_factory=lambda: next(_arrival_counter))
    finish_reason: FinishReason | None = None
    # Slots of max_num_seqs this sequence claims: itself plus the samples still to be forked from
    # it (n > 1, beams). Each fork moves one slot to the child (``Scheduler.fork``).
    reserved_seqs: int = 1
    # Prompt logprobs are asked for: every prompt token's logits are computed (no prefix-cache
    # hits), and the step returns the logits of each prompt position it computes.
    prompt_logits: bool = False
    # token_ids is prompt + output, kept as one list so decode steps never concatenate.
    token_ids: list[int] = field(init=False)
    # len(token_ids) at which the sequence is finished with reason "length": prompt + max_tokens
    # here; the scheduler lowers it to max_model_len when it takes the sequence (add, fork), so
    # that each appended token costs one comparison.
    token_limit: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.reserved_seqs < 1:
            raise ValueError(f"reserved_seqs must be >= 1; got {self.reserved_seqs}")
        self.token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self.token_limit = len(self.prompt_token_ids) + self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def replace_last_token(self, token_id: int) -> None:
        """Swap the last sampled token (not yet computed) for another: a forked sample or beam
        takes a different candidate from the same logits."""
        if not self.output_token_ids:
            raise ValueError("no sampled token to replace")
        self.output_token_ids[-1] = token_id
        self.token_ids[-1] = token_id

    def fork(self, seq_id: str) -> Sequence:
        """A copy that shares history but none of the scheduler-side identity (blocks are forked
        separately by the KV cache manager)."""
        child = Sequence(
            seq_id=seq_id,
            prompt_token_ids=self.prompt_token_ids,
            max_tokens=self.max_tokens,
            cache_salt=self.cache_salt,
            lora_id=self.lora_id,
            lora_path=self.lora_path,
            output_token_ids=list(self.output_token_ids),
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            block_hashes=list(self.block_hashes),
        )
        return child
