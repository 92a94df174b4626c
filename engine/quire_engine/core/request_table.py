"""The request table: every live request and its sample streams, by request id and by sequence id.

Ownership: the table is the one owner of request and sample bookkeeping. The engine's step loop,
beam search and aborts all go through its methods; nothing else keeps a request or a sample
index. The table drives the scheduler for every change of membership (``add``, ``fork``,
``retire``, ``abort``, ``fail``), so "in the table" and "known to the scheduler" never disagree:

* ``add`` is transactional: the scheduler validates and queues the first sequence, and only then
  is the request inserted; a ``ValueError`` leaves both exactly as before.
* ``retire`` ends one sample (a pruned beam) and returns its blocks.
* ``abort`` ends a request in any state, returns every block and removes it.
* ``fail`` ends a request whose own processing raised (sampling, detokenizing, stop checks, a beam
  step): its blocks are returned and its outputs finish with reason "abort" plus an error message;
  it stays in the table until ``remove`` so that the engine can still report it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quire_engine.core.beam_state import BeamState
from quire_engine.core.detokenizer import Detokenizer
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import FinishReason, Sequence

# A sample's RNG: a torch.Generator that the model side creates and the sampler consumes; the
# core only carries it.
Rng = Any


@dataclass(slots=True)
class Sample:
    """One output stream of a request: its sequence, RNG, detokenizer and output so far.

    This is the engine's live state of the stream; reports are snapshots of it
    (``engine.output_processor.completion``). ``tokens`` and ``logprobs`` are only ever
    appended to, so reports hand out ``Prefix`` views of them; the text so far is
    ``detok.text``."""

    seq: Sequence
    generator: Rng | None
    detok: Detokenizer
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Its grammar matcher under structured outputs (``structured/matchers``; opaque here).
    grammar: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample] = field(default_factory=list)
    beam: BeamState | None = None
    error: str | None = None  # set by RequestTable.fail
    # Token ids that end a sample when generated: the model's EOS ids (unless ``ignore_eos``)
    # and ``stop_token_ids``. Given by the engine, which knows the EOS ids.
    stop_ids: frozenset[int] = frozenset()
    # Token ids of each of ``params.bad_words`` (tokenized by the engine).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # Per prompt token: its log-probability and the top alternatives, by token id (None for the
    # first token, which nothing predicts); filled as the prompt is computed, when asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The compiled grammar of ``params.constraint`` (``structured/grammars``; opaque here).
    grammar: Any = None
    # Derived once here (params and beam never change) because the step reads them for every
    # row: ``single``, one sample stream and no beam; ``plain_greedy``, a single greedy stream
    # with nothing else to compute (no penalties or logprobs): its row is the batch argmax.
    single: bool = field(init=False)
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        self.single = self.beam is None and self.params.n == 1
        self.plain_greedy = self.single and self.params.argmax_only

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        if self.beam is not None:
            return self.beam.done
        samples = self.samples
        if len(samples) == 1:
            return self.params.n == 1 and samples[0].finish_reason is not None
        return len(samples) == self.params.n and all(s.finished for s in samples)


class RequestTable:
    """Live requests (insertion order) and the owner of every live sequence."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self._tokenizer = tokenizer
        self._requests: dict[str, Request] = {}
        self._owner: dict[str, tuple[Request, Sample]] = {}
        self._num_not_plain = 0  # live requests that are not plain greedy
        self.num_prompt_logprobs = 0  # live requests that want prompt logprobs
        # owner(seq_id): the request and sample of a live sequence (KeyError for an unknown id).
        # The dict's own lookup: the step loop calls it once per sampled sequence.
        self.owner: Callable[[str], tuple[Request, Sample]] = self._owner.__getitem__

    # ---- lookups -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def ids(self) -> list[str]:
        return list(self._requests)

    @property
    def all_plain_greedy(self) -> bool:
        """Every live request is one plain greedy stream (``Request.plain_greedy``)."""
        return not self._num_not_plain

    # ---- membership ----------------------------------------------------------------------
    def add(self, request: Request, first: Sample) -> None:
        """Queue ``request`` with its first sample; ``ValueError`` and no change if it cannot be
        taken (duplicate id, or the scheduler refuses the sequence)."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.samples:
            raise ValueError("a new request has no samples yet")
        self.scheduler.add(first.seq)  # validates length and pool fit; raises before mutating
        self._requests[request.request_id] = request
        self._num_not_plain += not request.plain_greedy
        self.num_prompt_logprobs += request.prompt_logprobs is not None
        self._register(request, first)

    def new_sample(
        self, request: Request, seq: Sequence, index: int, generator: Rng | None
    ) -> Sample:
        """A sample object for ``seq`` (not registered); its output starts empty."""
        want_lp = request.params.logprobs is not None
        detok = Detokenizer(self._tokenizer, request.prompt_token_ids)
        return Sample(
            seq,
            generator,
            detok,
            index,
            logprobs=[] if want_lp else None,
            cumulative_logprob=0.0 if want_lp or request.beam is not None else None,
        )

    def fork(
        self,
        request: Request,
        parent: Sample,
        seq_id: str,
        index: int,
        generator: Rng | None,
        last_token: int | None = None,
    ) -> Sample:
        """A new sample sharing ``parent``'s history (and, if it runs, its blocks). With
        ``last_token`` the child takes that token instead of the parent's last sampled one. A
        parent that already finished (max_tokens reached) yields a child finished alike."""
        child = parent.seq.fork(seq_id)
        if last_token is not None:
            child.replace_last_token(last_token)
        if parent.seq.is_finished:
            child.status = parent.seq.status
            child.finish_reason = parent.seq.finish_reason
        else:
            self.scheduler.fork(parent.seq, child)
        sample = self.new_sample(request, child, index, generator)
        self._register(request, sample)
        return sample

    def retire(self, request: Request, sample: Sample) -> None:
        """End one sample of a live request (a pruned beam): blocks back, sample dropped."""
        self._owner.pop(sample.seq.seq_id, None)
        self.scheduler.finish(sample.seq, FinishReason.ABORT)
        request.samples.remove(sample)

    def abort(self, request_id: str) -> Request | None:
        """End a request in any state and remove it; unknown ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._end(request)
        self.remove(request)
        return request

    def fail(self, request: Request, error: str) -> None:
        """End ``request`` because its own processing raised; it stays listed (finished, with
        ``error``) until ``remove``. Idempotent: the first error is kept."""
        if request.error is None:
            request.error = error
        self._end(request)

    def remove(self, request: Request) -> None:
        """Forget a finished request and its samples (their sequences are already finished)."""
        if self._requests.pop(request.request_id, None) is not None:
            self._num_not_plain -= not request.plain_greedy
            self.num_prompt_logprobs -= request.prompt_logprobs is not None
        for s in request.samples:
            self._owner.pop(s.seq.seq_id, None)

    def _register(self, request: Request, sample: Sample) -> None:
        request.samples.append(sample)
        self._owner[sample.seq.seq_id] = (request, sample)

    def _end(self, request: Request) -> None:
        for s in request.samples:
            self.scheduler.finish(s.seq, FinishReason.ABORT)  # idempotent; returns the blocks
            if s.finish_reason is None:
                s.finish_reason = FinishReason.ABORT
