"""Continuous-batching scheduler: which sequences run this step, with how many tokens each.

Pure Python. Each ``schedule()`` call fills a token budget (``max_num_batched_tokens``) and a
sequence cap (``max_num_seqs``), in this order:

1. running sequences, oldest first (one decode token each, or the next prefill chunk);
2. swapped sequences, oldest first (only when this step preempted nobody);
3. waiting sequences, FCFS (only when nothing is left swapped), reusing prefix-cache hits and
   splitting a prompt larger than the remaining budget into chunks (chunked prefill).

When a running sequence cannot get a block, the newest running sequence is preempted (FCFS), by
recompute (free its blocks, front of the waiting queue) or swap (move its blocks to the CPU pool).
Because the victim is always the newest, the oldest request always makes progress; a request that
could not fit even alone is rejected by ``add`` with a ``ValueError``.

Ownership: the scheduler owns every ``Sequence``'s ``status``, ``num_computed_tokens`` and
``num_cached_tokens`` and the queues; the engine calls ``update`` after each model step and
``finish``/``abort`` when a sequence ends. Every path out (finish, abort, preemption) releases
the blocks through the KV cache manager.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from quire_engine.core.config import CacheConfig, PreemptionMode, SchedulerConfig
from quire_engine.core.host_tier import HostMove
from quire_engine.core.knobs import resolved
from quire_engine.core.kv_cache_manager import KVCacheManager
from quire_engine.core.lora import BASE, AdapterSlots
from quire_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from quire_engine.core.stats import SchedulerStats, kv_demand_blocks


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan, in batch order, for the model runner.

    Per scheduled sequence: the sequence, how many new tokens it computes, the position of the
    first one, its block table (the live int32 id array: read it, never mutate it) and whether
    the step ends at its last known token (so its logits are sampled). The slot of every new
    token follows from the block tables (``slot_mapping()``); the runner computes it vectorized.
    Block moves are performed by the runner before the forward pass in this order:
    ``swap_out`` and ``offload`` (the only reads of device blocks this step may overwrite: an
    evicted block is offloaded before its new holder writes it), then ``swap_in``, ``load`` (host
    tier hits into fresh device blocks) and ``block_copies``.
    """

    block_size: int
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    block_tables: list[array[int]] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    offload: list[HostMove] = field(default_factory=list)  # (device, host): evicted prefixes
    load: list[HostMove] = field(default_factory=list)  # (host, device): host-tier hits
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def slot_mapping(self) -> list[int]:
        """Cache slot (block_id * block_size + offset) of every new token, in batch order."""
        bs = self.block_size
        slots: list[int] = []
        for table, start, n in zip(
            self.block_tables, self.start_positions, self.num_new_tokens, strict=True
        ):
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        return slots


class PromptLogitSpan(NamedTuple):
    """Rows of prompt logits one step computes for a sequence that wants prompt logprobs: the
    logits at positions ``first .. first + rows - 1`` of sequence ``batch_index`` of the step,
    each predicting the prompt token after it."""

    batch_index: int
    seq: Sequence
    first: int
    rows: int


def prompt_logit_spans(out: SchedulerOutput) -> list[PromptLogitSpan]:
    """The step's prompt-logit rows, in batch order (empty for sequences that did not ask)."""
    spans = []
    for i, seq in enumerate(out.seqs):
        if seq.prompt_logits:
            start = out.start_positions[i]
            end = min(start + out.num_new_tokens[i], len(seq.prompt_token_ids) - 1)
            if end > start:
                spans.append(PromptLogitSpan(i, seq, start, end - start))
    return spans


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, max_loras: int = 0
    ) -> None:
        """``max_loras``: the model's adapter slots per step (0: LoRA off), see ``core/lora``."""
        self.config = scheduler_config
        self.cache_config = cache_config
        # Limits derived at start-up (plan_cache): resolved in the config by now.
        self.max_model_len = resolved(scheduler_config.max_model_len, "max_model_len")
        self.max_num_batched_tokens = resolved(
            scheduler_config.max_num_batched_tokens, "max_num_batched_tokens"
        )
        self.kv = KVCacheManager(cache_config)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival: the tail is the newest
        self.swapped: list[Sequence] = []  # sorted by arrival: the head comes back first
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = {mode: 0 for mode in PreemptionMode}
        self.adapter_slots = AdapterSlots(max_loras)

    # ---- admission and exits -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; rejects what could never run (``ValueError``, nothing held)."""
        if seq.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        max_len = self.max_model_len
        if seq.num_tokens > max_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens, more than max_model_len={max_len}"
            )
        peak = min(seq.num_tokens + seq.max_tokens, max_len)
        need = self.kv.max_blocks_held(peak, self.max_num_batched_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks ({peak} tokens at block_size="
                f"{self.kv.block_size}) but the pool has only num_blocks="
                f"{self.kv.num_blocks}; lower max_tokens or raise the KV cache size"
            )
        seq.status = SequenceStatus.WAITING
        seq.token_limit = min(seq.token_limit, max_len)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add ``child`` as a copy of an unfinished ``parent``.

        A running parent's blocks are shared (ref + 1 each, copy-on-write later). A parent that
        holds no device blocks (waiting or swapped) cannot share them: the child waits at the
        front of the queue and is prefilled on its own (the prefix cache usually hits)."""
        if self.seqs.get(parent.seq_id) is not parent:
            raise ValueError(f"can only fork an unfinished sequence; {parent.seq_id!r} is not")
        if child.seq_id in self.seqs:
            raise ValueError(f"duplicate sequence id {child.seq_id!r}")
        self.seqs[child.seq_id] = child
        child.token_limit = min(child.token_limit, self.max_model_len)
        if parent.reserved_seqs > 1:  # the child takes a slot its parent reserved for it
            parent.reserved_seqs -= 1
        if parent.status is SequenceStatus.RUNNING:
            self.kv.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            bisect.insort(self.running, child, key=_arrival)
        else:
            child.status = SequenceStatus.WAITING
            child.num_computed_tokens = 0
            self.waiting.appendleft(child)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence in any state and release all it holds. Idempotent."""
        if self.seqs.pop(seq.seq_id, None) is None:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq_id: str) -> Sequence | None:
        """Client gone: finish with reason "abort". Unknown or finished ids are ignored."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.kv.block_size)
        budget = self.max_num_batched_tokens
        kv = self.kv
        running = self.running
        # The decode loop below is the hot path of every step (hundreds of sequences): the output
        # lists are appended inline rather than through _emit. Preemption pops the newest
        # sequences off the tail of ``running`` while it is iterated: a list iterator stops at
        # the current length, so the victims are never visited (nor is anything after a
        # sequence that preempted itself).
        seqs, counts, starts = out.seqs, out.num_new_tokens, out.start_positions
        tables, samples = out.block_tables, out.samples
        for seq in running:
            if budget <= 0:
                break
            start = seq.num_computed_tokens
            known = len(seq.token_ids)
            n = known - start
            if n > budget:
                n = budget
            elif n == 0:  # waiting for the engine (e.g. a parent about to be forked)
                continue
            while (ids := kv.allocate_slots(seq, n)) is None:
                victim = running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(n)
                starts.append(start)
                tables.append(ids)
                samples.append(start + n == known)
                budget -= n
        out.num_batched_tokens = self.max_num_batched_tokens - budget

        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
        if not out.preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        out.block_copies = kv.take_copies()
        out.offload, out.load = kv.take_host_moves()
        return out

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        out.start_positions.append(start)
        out.block_tables.append(self.kv.live_ids(seq.seq_id))
        out.samples.append(start + n == len(seq.token_ids))
        out.num_batched_tokens += n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        mode = self.config.preemption_mode
        if mode is PreemptionMode.SWAP and self.kv.can_swap_out(seq.seq_id):
            out.swap_out += self.kv.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_arrival)
        else:
            # Recompute (or swap with a full CPU pool): drop the K/V, re-prefill later. Full
            # blocks stay cached in the free queue, so the re-prefill usually hits.
            mode = PreemptionMode.RECOMPUTE
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.num_preemptions[mode] += 1
        out.preempted.append(seq)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        kv = self.kv
        slots = self._free_slots() if self.swapped else 0
        while self.swapped and budget > 0 and self.swapped[0].reserved_seqs <= slots:
            seq = self.swapped[0]
            if not self._adapter_fits(seq):
                break
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            growth = kv.num_blocks_for(seq.num_computed_tokens + n) - len(
                kv.cpu_block_ids(seq.seq_id)
            )
            if not kv.can_swap_in(seq.seq_id, max(growth, 0)):
                break
            out.swap_in += kv.swap_in(seq.seq_id)
            if kv.allocate_slots(seq, n) is None:  # cannot fail: checked above
                raise RuntimeError("swap-in accounting error")
            self.swapped.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            self._emit(out, seq, n)
            budget -= n
            slots -= seq.reserved_seqs
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kv = self.kv
        slots = self._free_slots() if self.waiting else 0
        while self.waiting and budget > 0 and self.waiting[0].reserved_seqs <= slots:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                break  # first come, first served: it waits for an adapter to leave the step
            hits = kv.find_prefix(seq)  # on the device, then in the host tier
            num_hit = hits.num_blocks * kv.block_size
            n = min(seq.num_tokens - num_hit, budget)
            cached = kv.allocate_with_prefix(seq, n, hits.device, hits.host)
            if cached is None:
                break
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens < 0:  # a lookup only once: a victim mostly finds itself
                seq.num_cached_tokens = cached
                kv.note_prefix_query(seq.num_tokens, num_hit, len(hits.host) * kv.block_size)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            self._emit(out, seq, n)
            budget -= n
            slots -= seq.reserved_seqs

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter joins the running ones within the step's adapter slots."""
        if seq.lora_id == BASE:
            return True
        return self.adapter_slots.admits((s.lora_id for s in self.running), seq.lora_id)

    def _free_slots(self) -> int:
        """max_num_seqs minus the slots running sequences hold (forks yet to come included)."""
        return self.config.max_num_seqs - sum(s.reserved_seqs for s in self.running)

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int]) -> list[Sequence]:
        """``advance`` with the sampled tokens given by sequence id (absent: none)."""
        get = sampled.get
        return self.advance(out, [get(seq.seq_id) for seq in out.seqs])

    def advance(self, out: SchedulerOutput, tokens: Sequence_[int | None]) -> list[Sequence]:
        """Apply a finished step: advance progress and append sampled tokens.

        ``tokens[k]`` is the token chosen for ``out.seqs[k]`` (None: nothing to append, e.g. a
        prefill chunk that samples nothing). Returns the sequences that reached ``max_tokens``
        or ``max_model_len`` (finished with reason "length"). Sequences aborted while the step
        ran are skipped.
        """
        finished = []
        kv = self.kv
        windowed = kv.sliding_window is not None
        running = SequenceStatus.RUNNING
        # Hot (once per sequence per step): locals only, Scheduler.append inlined.
        for seq, n, token in zip(out.seqs, out.num_new_tokens, tokens, strict=True):
            if seq.status is not running:
                continue
            seq.num_computed_tokens += n
            if windowed:  # blocks no future query can see
                kv.release_out_of_window(seq)
            if token is not None:
                seq.append_token(token)
                if len(seq.token_ids) >= seq.token_limit:
                    self.finish(seq, FinishReason.LENGTH)
                    finished.append(seq)
        return finished

    def append(self, seq: Sequence, token: int) -> bool:
        """Append a chosen token to a running sequence whose tokens are all computed; finishes it
        (reason "length", returns True) at ``max_tokens`` or ``max_model_len``."""
        seq.append_token(token)
        if len(seq.token_ids) >= seq.token_limit:
            self.finish(seq, FinishReason.LENGTH)
            return True
        return False

    # ---- observability -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def stats(self) -> SchedulerStats:
        """A snapshot for the metrics; O(sequences), plain arithmetic."""
        kv = self.kv
        return SchedulerStats(
            pool=kv.stats(),
            kv_demand_blocks=kv_demand_blocks(self),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            num_preemptions=MappingProxyType(dict(self.num_preemptions)),
            waiting_ids=frozenset(seq.seq_id for seq in self.waiting),
            host=kv.host.stats() if kv.host is not None else None,
            running_loras=_adapters(self.running) if self.adapter_slots.max_loras else (),
            waiting_loras=_adapters(self.waiting) if self.adapter_slots.max_loras else (),
        )


def _adapters(seqs: Iterable[Sequence]) -> tuple[int, ...]:
    return tuple(sorted({seq.lora_id for seq in seqs} - {BASE}))


def _arrival(seq: Sequence) -> int:
    return seq.arrival
