"""One step's sampled rows, from the forward's logits to the step's reports: one class per path.

``LLMEngine.step`` builds one ``StepBatch`` per step from the scheduler's output and runs its
three stages in order: ``sample`` (choose the tokens), ``update`` (apply them to the scheduler:
progress, appended tokens, "length" finishes) and ``process`` (the output stage: emission, stop
checks, forks, beams, reports). The paths:

* ``GreedyBatch``, the plain greedy lane: every live request is one plain greedy stream (the
  common serving case, and where per-sequence costs add up): one argmax for the batch, no
  sampling plan, each request emitted and reported in one pass.
* ``PlannedBatch``, every other step: one ``PlanRow`` per sampled token. Its tokens come from
  one argmax when every row is argmax-only (``argmax_rows``), else from the batched sampler
  (``sample_rows``); a request with ``n > 1`` on its first token plans ``n`` rows and forks its
  samples (``OutputProcessor.emit_fanned``); a beam search's rows are not sampled but handed to
  the search (``OutputProcessor.hand_off_beams``).

Ownership: a batch lives for one step and owns only its plan and chosen tokens; requests and
samples are the ``RequestTable``'s, sequences the ``Scheduler``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress
from typing import Protocol

import torch

from quire_engine.core.outputs import RequestOutput
from quire_engine.core.request_table import Request
from quire_engine.core.scheduler import Scheduler, SchedulerOutput
from quire_engine.engine.output_processor import BeamRow, OutputProcessor
from quire_engine.model.row_sampling import (
    ArgmaxFn,
    BitmaskFn,
    DrawFn,
    PlanRow,
    Sampled,
    argmax_rows,
    sample_rows,
)

# A request's sample ``j``'s generator (the engine's ``_fork_generator``).
ForkGenerator = Callable[[Request, int], torch.Generator | None]


class StepBatch(Protocol):
    def sample(self, logits: torch.Tensor, draw: DrawFn, argmax: ArgmaxFn) -> None:
        """Choose the tokens from ``logits`` [sampling rows, vocab], in batch order."""

    def update(self, scheduler: Scheduler) -> None:
        """Apply the chosen tokens to the scheduler (a failed request's are skipped)."""

    def process(self) -> list[RequestOutput]:
        """The output stage: the reports of the requests that progressed."""


class GreedyBatch:
    """A step in which every live request is one plain greedy stream."""

    __slots__ = ("ids", "out", "outputs", "seqs")

    def __init__(self, out: SchedulerOutput, outputs: OutputProcessor) -> None:
        self.out, self.outputs = out, outputs
        flags = out.samples
        self.seqs = out.seqs if all(flags) else list(compress(out.seqs, flags))
        self.ids: list[int] = []

    def sample(self, logits: torch.Tensor, draw: DrawFn, argmax: ArgmaxFn) -> None:
        if self.seqs:
            self.ids = argmax_rows(logits, len(self.seqs), argmax)

    def update(self, scheduler: Scheduler) -> None:
        out, ids = self.out, self.ids
        if len(self.seqs) == len(out.seqs):
            tokens: list[int | None] = ids  # type: ignore[assignment]  # invariance of list
        else:  # some sequences only computed a prefill chunk
            chosen = iter(ids)
            tokens = [next(chosen) if f else None for f in out.samples]
        scheduler.advance(out, tokens)

    def process(self) -> list[RequestOutput]:
        outputs = self.outputs
        owner, emit, report = outputs.requests.owner, outputs.emit, outputs.output_single
        reports = []
        for seq, tok in zip(self.seqs, self.ids, strict=True):
            req, smp = owner(seq.seq_id)
            try:
                emit(req, smp, tok, None, None)
            except Exception as exc:
                outputs.fail(req, exc)
            reports.append(report(req, smp))
        return reports


class PlannedBatch:
    """Any other step: the planned rows (fan-outs included), and the beams' rows apart."""

    __slots__ = (
        "argmax_only", "beams", "bitmask", "fanned", "logits", "out", "outputs", "plan",
        "tokens", "touched",
    )  # fmt: skip

    def __init__(
        self,
        out: SchedulerOutput,
        outputs: OutputProcessor,
        fork_generator: ForkGenerator,
        bitmask: BitmaskFn,
    ) -> None:
        """Plan the step: one row per sampling sequence, ``n`` for a request forking its
        samples on this step's first token; beams' rows apart."""
        self.out, self.outputs, self.bitmask = out, outputs, bitmask
        owner, isolated = outputs.requests.owner, outputs.isolated
        touched: dict[str, Request] = {}
        plan: list[PlanRow] = []
        beams: list[BeamRow] = []
        fanned = False  # some request forks samples this step (n > 1, first token)
        argmax_only = True  # every row argmax-only: the sampler's single argmax serves them
        i = 0
        for seq, samples in zip(out.seqs, out.samples, strict=True):
            if not samples:
                continue
            req, smp = owner(seq.seq_id)
            touched[req.request_id] = req
            if req.beam is not None:
                beams.append(BeamRow(req, seq, i))
            elif req.params.n > 1 and len(req.samples) == 1 and not seq.output_token_ids:
                fanned = True
                for j in range(req.params.n):
                    gen = smp.generator if j == 0 else isolated(req, fork_generator, req, j)
                    plan.append(PlanRow(req, smp, j, i, gen))
            else:
                plan.append(PlanRow(req, smp, 0, i, smp.generator))
                argmax_only = argmax_only and req.params.argmax_only
            i += 1
        self.touched, self.plan, self.beams = touched, plan, beams
        self.fanned, self.argmax_only = fanned, argmax_only
        self.tokens: list[Sampled] = []
        self.logits: torch.Tensor | None = None

    def sample(self, logits: torch.Tensor, draw: DrawFn, argmax: ArgmaxFn) -> None:
        self.logits = logits  # the beams' rows are read in ``process``
        plan = self.plan
        if self.argmax_only and not self.fanned and not self.beams:
            self.tokens = [Sampled(t, None, None) for t in argmax_rows(logits, len(plan), argmax)]
        else:
            fail = self.outputs.fail
            self.tokens = sample_rows(logits, plan, bitmask=self.bitmask, fail=fail, draw=draw)

    def update(self, scheduler: Scheduler) -> None:
        primary = {
            smp.seq.seq_id: tok
            for (req, smp, j, _, _), (tok, _, _) in zip(self.plan, self.tokens, strict=True)
            if j == 0 and req.error is None
        }
        scheduler.update(self.out, primary)  # a failed request's sequences are finished: skipped

    def process(self) -> list[RequestOutput]:
        outputs, plan, tokens = self.outputs, self.plan, self.tokens
        if self.fanned:
            outputs.emit_fanned(plan, tokens)
        else:
            one_pass = not self.beams and len(self.touched) == len(plan)
            reports = outputs.emit_rows(plan, tokens, report=one_pass)
            if one_pass:
                return reports
        if self.beams:
            assert self.logits is not None
            outputs.hand_off_beams(self.beams, self.logits)
        return [outputs.output(req) for req in self.touched.values()]
