"""The output stage of a step: what the chosen tokens do to their requests, and the reports.

``OutputProcessor`` takes each sampled token to its sample: it appends it (with its logprobs),
detokenizes it, advances the sample's grammar, checks the stops (an EOS id unless ``ignore_eos``,
a stop token id, a stop string, cut from the text unless ``include_stop_str_in_output``) and a
completed grammar, and finishes the sample's sequence through ``Scheduler.finish`` when one
applies. It forks the ``n - 1`` further samples of a request on its first token, hands each
beam's logits to beam search, and renders every touched request into this step's
``RequestOutput`` (removing it from the table once finished).

Ownership: it owns no state of its own. The requests and samples are the ``RequestTable``'s, the
sequences the ``Scheduler``'s; it mutates both through their methods (``fork``, ``fail``,
``remove``, ``finish``).

Failure isolation: whatever raises while one request's results are handled (its detokenization,
grammar, stop checks, forks, beam step) fails that request only (``isolated`` / ``fail``): its
blocks are returned and its report ends with ``finish_reason`` "abort" and ``error`` set, while
its batch-mates go on.

Everything here runs once per sampled sequence, hundreds of times per step: no per-row
closures, one ``try`` per row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from operator import attrgetter
from typing import Any, NamedTuple, TypeVar

import torch

from quire_engine.core import beam_search
from quire_engine.core.beam_state import TopTokens
from quire_engine.core.detokenizer import find_stop
from quire_engine.core.outputs import CompletionOutput, Prefix, RequestOutput
from quire_engine.core.request_table import Request, RequestTable, Sample
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from quire_engine.model.row_sampling import PlanRow, Sampled
from quire_engine.structured import matchers

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_index = attrgetter("index")
# Read once per sequence per step: a module constant, as an enum member lookup costs ~80 ns.
_FINISHED = SequenceStatus.FINISHED


class BeamRow(NamedTuple):
    """A beam's sequence that sampled this step, and its row of the step's logits."""

    request: Request
    seq: Sequence
    logits_row: int


class OutputProcessor:
    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
    ) -> None:
        """``tokenizer``: what beam search renders finished beams with (``decode``)."""
        self.requests = requests
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    # ---- emission ------------------------------------------------------------------------
    def emit(
        self,
        req: Request,
        smp: Sample,
        token: int,
        logprob: float | None,
        top: dict[int, float] | None,
    ) -> None:
        """Take ``token`` to ``smp``: append, detokenize, grammar, stops. Raises on a fault of
        this request (the callers isolate it)."""
        smp.tokens.append(token)
        if logprob is not None and smp.cumulative_logprob is not None:
            smp.cumulative_logprob += logprob
        if top is not None and smp.logprobs is not None:
            smp.logprobs.append(top)
        new_text = smp.detok.add(token)
        grammar = smp.grammar
        if grammar is not None and not matchers.accept(grammar, token):
            raise RuntimeError(f"token {token} is outside the request's grammar")
        if (token in req.stop_ids or req.params.stop) and self._stopped(
            req, smp, token, len(new_text)
        ):
            return
        if grammar is not None and matchers.terminated(grammar) and not smp.seq.is_finished:
            self.scheduler.finish(smp.seq, FinishReason.STOP)  # complete (ignore_eos aside)
        if smp.seq.status is _FINISHED:
            smp.finish_reason = smp.seq.finish_reason

    def _stopped(self, req: Request, smp: Sample, token: int, new_len: int) -> bool:
        """Finish ``smp`` if ``token`` (whose text added ``new_len`` characters) stops it: an EOS
        id (unless ``ignore_eos``), a stop token id, or a stop string (cut from the text)."""
        params = req.params
        stop_reason: str | int | None = None
        if token in self.eos_token_ids and not params.ignore_eos:
            stop_reason = None  # EOS: no stop_reason (vLLM's convention)
        elif token in params.stop_token_ids:
            stop_reason = token
        else:
            detok = smp.detok
            hit = find_stop(detok.text, new_len, params.stop)
            if hit is None:
                return False
            idx, stop_reason = hit
            end = idx + len(stop_reason) if params.include_stop_str_in_output else idx
            detok.text = detok.text[:end]
        self.scheduler.finish(smp.seq, FinishReason.STOP)
        smp.finish_reason, smp.stop_reason = FinishReason.STOP, stop_reason
        return True

    def emit_rows(
        self, plan: list[PlanRow], tokens: list[Sampled], report: bool
    ) -> list[RequestOutput]:
        """Emit a step of one row per request (no forks). ``report``: every request has exactly
        one row and no beam follows, so nothing later touches a request once its row is
        emitted; each is reported in the same pass (the reports are returned; else none)."""
        emit, output = self.emit, self.output
        reports = []
        for (req, smp, _, _, _), (tok, lp, top) in zip(plan, tokens, strict=True):
            if req.error is None:
                try:
                    emit(req, smp, tok, lp, top)
                except Exception as exc:
                    self.fail(req, exc)
            if report:
                reports.append(output(req))
        return reports

    def emit_fanned(self, plan: list[PlanRow], tokens: list[Sampled]) -> None:
        """Emit a step in which some request forks its ``n > 1`` samples. Per request: fork
        every new sample before any stop check can finish (and free) its parent, then emit the
        tokens. A request with one row skips the grouping."""
        by_request: dict[str, list[int]] = {}
        for k, (req, smp, j, _, _) in enumerate(plan):
            if j == 0 and (k + 1 == len(plan) or plan[k + 1].sample_index == 0):
                if req.error is None:
                    tok, lp, top = tokens[k]
                    self.isolated(req, self.emit, req, smp, tok, lp, top)
            else:
                by_request.setdefault(req.request_id, []).append(k)
        for ks in by_request.values():
            req = plan[ks[0]].request
            if req.error is None:
                self.isolated(req, self._fork, req, [(plan[k], tokens[k]) for k in ks])

    def _fork(self, req: Request, rows: list[tuple[PlanRow, Sampled]]) -> None:
        streams = [
            smp
            if j == 0
            else self.requests.fork(req, smp, f"{req.request_id}/{j}", j, gen, last_token=tok)
            for (_, smp, j, _, gen), (tok, _, _) in rows
        ]
        if req.grammar is not None:  # each fork's own matcher, at the first token like its parent
            for stream in streams[1:]:
                stream.grammar = matchers.new_matcher(req.grammar)
        for stream, (_, (tok, lp, top)) in zip(streams, rows, strict=True):
            self.emit(req, stream, tok, lp, top)

    def hand_off_beams(self, beams: Iterable[BeamRow], logits: torch.Tensor) -> None:
        """Give each beam's logits row to its beam search; a search whose beams have all
        reported advances (forks, prunes, finishes)."""
        for req, seq, i in beams:
            if req.error is None and req.request_id in self.requests:
                self.isolated(req, self._beam_logits, req, seq, logits[i])

    def _beam_logits(self, req: Request, seq: Sequence, logits: torch.Tensor) -> None:
        state = req.beam
        assert state is not None
        logprobs = torch.log_softmax(logits, dim=-1).cpu()  # [vocab]
        k = min(beam_search.candidates_per_beam(state.width), logprobs.shape[0])
        values, ids = logprobs.topk(k)
        state.pending[seq.seq_id] = TopTokens(values.tolist(), ids.tolist())
        if not state.ready:
            return
        beam_search.advance(self.requests, req, state, self.eos_token_ids)

    # ---- isolation -----------------------------------------------------------------------
    def isolated(self, req: Request, fn: Callable[..., _T], *args: object) -> _T | None:
        """``fn(*args)``, failing only ``req`` (not the batch) if it raises."""
        if req.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self.fail(req, exc)
            return None

    def fail(self, req: Request, exc: BaseException) -> None:
        """Finish ``req`` with ``error`` (its blocks returned); the batch goes on."""
        logger.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
        self.requests.fail(req, f"internal error while generating: {type(exc).__name__}: {exc}")

    # ---- rendering -----------------------------------------------------------------------
    def output_single(self, req: Request, smp: Sample) -> RequestOutput:
        """``output`` of a single-stream request, given its sample: it reads the sample's state
        directly instead of through ``Request.finished`` (a failed request's sample is finished
        with "abort", so ``error`` needs no test here)."""
        finished = smp.finish_reason is not None
        if finished:
            self.requests.remove(req)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [completion(smp, finished)],
            finished, req.error, smp.seq.num_cached_tokens, req.prompt_logprobs,
        )  # fmt: skip

    def output(self, req: Request) -> RequestOutput:
        """This step's report of ``req`` (removing it from the table once finished). Runs once
        per request per step."""
        if req.single:
            return self.output_single(req, req.samples[0])
        finished = req.finished
        if finished:
            self.requests.remove(req)
        if req.beam is not None:
            outputs = beam_search.outputs(self.tokenizer, req.beam) if finished else []
        else:
            outputs = [completion(s, finished) for s in sorted(req.samples, key=_index)]
        cached = req.samples[0].seq.num_cached_tokens if req.samples else 0
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outputs,
            finished,
            req.error,
            cached,
            req.prompt_logprobs,
        )


def completion(smp: Sample, finished: bool) -> CompletionOutput:
    """A snapshot of a sample's output for this step's report. Unfinished, its token and
    logprob lists are ``Prefix`` views (constant time; the engine keeps appending to the lists);
    finished, plain copies (the lists never change again, and callers get lists)."""
    tokens, lps = smp.tokens, smp.logprobs
    if finished:
        token_ids: Sequence_[int] = tokens[:]
        logprobs: Sequence_[dict[int, float]] | None = lps[:] if lps is not None else None
    else:
        token_ids = Prefix(tokens, len(tokens))
        logprobs = Prefix(lps, len(lps)) if lps is not None else None
    return CompletionOutput(  # positional: this runs once per sequence per step
        smp.index,
        smp.detok.text,
        token_ids,
        smp.cumulative_logprob,
        logprobs,
        smp.finish_reason,
        smp.stop_reason,
    )
