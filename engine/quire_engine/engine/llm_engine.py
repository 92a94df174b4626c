"""The synchronous engine loop: requests in, one scheduler step -> model step -> sampling per call.

``LLMEngine`` owns the scheduler (control side), the model runner (tensor side) and every request's
sampling state. ``step()`` returns the outputs of the requests that progressed. The offline ``LLM``
and the async server are thin layers over it.

Request and sample bookkeeping lives in one ``RequestTable`` (``self.requests``); the step loop,
beam search and aborts use its methods. ``add_request`` validates everything before the table and
the scheduler change, so a rejected request leaves no trace.

Failure isolation: an exception raised while handling one request's results (its sampling rows,
forks, detokenization, stop checks or beam step) finishes that request only: its blocks are
returned and its ``RequestOutput`` ends with ``finish_reason`` "abort" and ``error`` set. Only a
failure of the batch itself (scheduling, the model forward, applying the step to the scheduler)
propagates out of ``step()``: the engine is then unusable and its owner must treat it as dead.

Sequences and requests: a request has one sample stream per ``n``; all but the first are forked
from the first once its prompt is computed, so the prompt's blocks are shared (copy-on-write on
the partially filled last block). Beam search (see ``beam_search``) forks and prunes beams the
same way. Every exit (stop, length, abort, rejection) goes through ``Scheduler.finish``, which
returns the sequence's blocks.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from itertools import compress
from operator import attrgetter
from typing import NamedTuple, TypeVar

import torch

from quire_engine.core import beam_search
from quire_engine.core.beam_state import TopTokens
from quire_engine.core.config import EngineConfig
from quire_engine.core.detokenizer import find_stop
from quire_engine.core.outputs import CompletionOutput, Prefix, RequestOutput
from quire_engine.core.request_table import Request, RequestTable, Sample
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.scheduler import (
    PromptLogitSpan,
    Scheduler,
    SchedulerOutput,
    prompt_logit_spans,
)
from quire_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from quire_engine.engine.startup import StartupPhase, StartupTimes
from quire_engine.model import loader as model_loader
from quire_engine.model.cache_plan import plan_cache
from quire_engine.model.runner import ModelRunner
from quire_engine.model.sampler import SampleResult, SampleRow, greedy_tokens, sample
from quire_engine.parallel.group import WorkerGroup
from quire_engine.structured import matchers
from quire_engine.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_index = attrgetter("index")
# Read once per sequence per step: a module constant, as an enum member lookup costs ~80 ns.
_FINISHED = SequenceStatus.FINISHED


class Sampled(NamedTuple):
    """What sampling chose for one planned row."""

    token: int
    logprob: float | None  # the token's, when the request asked for logprobs
    top: dict[int, float] | None  # the top logprobs by token id, when asked for


_NOTHING = Sampled(0, None, None)  # the row of a failed request: never emitted


class PlanRow(NamedTuple):
    """One planned sampling row of a step."""

    request: Request
    sample: Sample  # the sample it continues (the parent, for a sample forked this step)
    sample_index: int  # j within the request (j > 0: forked this step, n > 1)
    logits_row: int  # its row of the step's logits
    generator: torch.Generator | None  # the RNG it draws from


def check_placement(device: str, dtype: str) -> None:
    """Raise ``ValueError`` for a ``--device`` / ``--dtype`` pair this machine cannot serve; what
    the engine checks first, before loading anything (the server checks it before listening)."""
    model_loader.resolve_dtype(dtype, model_loader.resolve_device(device))


class LLMEngine:
    def __init__(self, config: EngineConfig, startup: StartupTimes | None = None) -> None:
        """``startup``: the recorder of this engine's start-up phases (default: one counting
        from now; ``serve`` passes one counting from process start)."""
        self.config = config
        self.startup = startup if startup is not None else StartupTimes()
        self.device = model_loader.resolve_device(config.model.device)
        self.dtype = model_loader.resolve_dtype(config.model.dtype, self.device)
        # Tensor parallelism: this process is rank 0; the other ranks start first, as loading
        # and sizing the pool are collective.
        self.parallel = WorkerGroup(config) if config.parallel.tensor_parallel_size > 1 else None
        # The workers stop with the engine, even one never closed (or at interpreter exit).
        self._stop_workers = weakref.finalize(self, self.parallel.close) if self.parallel else None
        try:
            self._load(config)
        except BaseException:
            self.close()
            raise
        self.requests = RequestTable(self.scheduler, self.tokenizer)
        # Structured outputs: compiled grammars, shared with the server's compile thread.
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._rng = torch.Generator().manual_seed(config.seed)

    def _load(self, config: EngineConfig) -> None:
        comm = self.parallel.comm if self.parallel is not None else None
        phase = self.startup.phase
        # A wait for a shared model cache goes here, inside phase(StartupPhase.MODEL_CACHE).
        with phase(StartupPhase.WEIGHTS):
            model = config.model
            loaded = model_loader.load(
                model.model, self.device, self.dtype, model.chat_template, comm
            )
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        # The tokenizer's EOS and generation_config.json's eos_token_id list.
        self.eos_token_ids: frozenset[int] = frozenset(loaded.eos_token_ids)
        self.sampling_defaults = loaded.sampling_defaults
        self.vocab_size = int(getattr(loaded.model.config, "vocab_size"))  # noqa: B009
        with phase(StartupPhase.KV_PROFILE):
            plan = plan_cache(config, loaded, self.device, self.dtype, comm)
        # The sub-configs with the derived values resolved, as the parts take them.
        self.scheduler = Scheduler(plan.scheduler, plan.cache)
        self.max_model_len = self.scheduler.max_model_len
        num_blocks, num_cpu_blocks = plan.num_blocks, plan.num_cpu_blocks
        with phase(StartupPhase.KV_ALLOCATE):
            self.runner = ModelRunner(
                loaded.model,
                plan.shape,
                num_blocks=num_blocks,
                num_cpu_blocks=num_cpu_blocks,
                device=self.device,
                layers=loaded.layers,
                native_linears=comm is None,
            )
        if self.parallel is not None:
            self.runner.publish = self.parallel.publish
        logger.info(
            "KV pool: %d blocks x %d tokens (%.1f MiB per rank), %d CPU swap blocks, "
            "max_model_len %d, tensor_parallel_size %d",
            num_blocks,
            plan.cache.block_size,
            num_blocks * plan.shape.bytes_per_block / 2**20,
            num_cpu_blocks,
            self.max_model_len,
            config.parallel.tensor_parallel_size,
        )

    def check_health(self) -> None:
        """``RuntimeError`` when a tensor-parallel rank has exited (between steps; a rank that
        dies during a step makes that step raise)."""
        if self.parallel is not None:
            self.parallel.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; the engine is unusable after)."""
        if self._stop_workers is not None:
            self._stop_workers()

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in ids if _not_token(t, self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        beam_width: int | None = None,
    ) -> None:
        """Queue a request; ``ValueError`` for bad input or one that cannot fit. Transactional:
        everything is validated and built first, and a rejection leaves the request table and
        the scheduler exactly as they were."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams; got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        width = self._check_fit(params, beam_width)
        text, ids = self.tokenize(prompt)
        compiled = None
        if params.constraint is not None:
            if beam_width is not None:
                raise ValueError("structured outputs do not combine with beam search")
            compiled = self.grammars.compile(params.constraint)  # a cache hit when served
        beam = None
        if beam_width is not None:
            beam = beam_search.BeamState(beam_width, ignore_eos=params.ignore_eos)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        req = Request(
            request_id,
            text,
            ids,
            params,
            beam=beam,
            stop_ids=stop_ids,
            bad_words=self._bad_words(params.bad_words),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            grammar=compiled,
        )
        seq = Sequence(
            f"{request_id}/0",
            ids,
            max_tokens=params.max_tokens,
            cache_salt=cache_salt,
            reserved_seqs=width,
            prompt_logits=params.prompt_logprobs is not None,
        )
        first = self.requests.new_sample(req, seq, 0, self._fork_generator(req, 0))
        if compiled is not None:
            first.grammar = matchers.new_matcher(compiled)
        self.requests.add(req, first)  # the scheduler's checks; nothing changed if it raises
        if req.beam is not None:
            req.beam.active.append(seq.seq_id)

    def _check_fit(self, params: SamplingParams, beam_width: int | None) -> int:
        """Engine-dependent limits; returns how many sequences the request runs at once."""
        width = params.n if beam_width is None else beam_width
        name = "n" if beam_width is None else "beam_width"
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {width!r}")
        limit = self.scheduler.config.max_num_seqs
        if width > limit:
            raise ValueError(f"{name}={width} exceeds max_num_seqs={limit}")
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", [t for t, _ in params.logit_bias]),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be in [0, {self.vocab_size}); got {bad[:5]}")
        return width

    def _bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids, as vLLM takes them: the word alone and with a leading
        space (how it appears after another word)."""
        out: set[tuple[int, ...]] = set()
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer(text, add_special_tokens=False).input_ids)
                if ids:
                    out.add(ids)
        return tuple(sorted(out))

    def abort_request(self, request_id: str) -> None:
        """Stop a request in any state and free its blocks. Unknown ids are ignored."""
        self.requests.abort(request_id)

    def has_unfinished(self) -> bool:
        return len(self.requests) > 0

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass; outputs of the requests that progressed
        (including those that failed in this step, finished with ``error``).

        Everything after the forward runs once per sampled sequence, hundreds of times per step,
        so the common case (one row per request, no fan-out) takes the straight path: no
        per-row closures or grouping, one ``try`` per row for fault isolation."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        spans = prompt_logit_spans(out) if self.requests.num_prompt_logprobs else []
        # [num_sampling_seqs (+ prompt rows), vocab]
        try:
            logits = self.runner.execute(out, spans) if spans else self.runner.execute(out)
        except Exception as exc:
            if self.parallel is not None:
                self.parallel.blame(exc)  # name the rank that died, if one did
            raise
        if spans:
            num_sampling = len(logits) - sum(s.rows for s in spans)
            self._record_prompt_logprobs(spans, logits[num_sampling:])
            logits = logits[:num_sampling]
        if self.requests.all_plain_greedy:
            return self._step_plain_greedy(out, logits)

        owner = self.requests.owner
        touched: dict[str, Request] = {}
        plan: list[PlanRow] = []
        beam_rows: list[tuple[Request, Sequence, int]] = []
        fanned = False  # some request forks samples this step (n > 1, first token)
        argmax_only = True  # every row argmax-only: the sampler's single argmax serves them
        i = 0
        for seq, samples in zip(out.seqs, out.samples, strict=True):
            if not samples:
                continue
            req, smp = owner(seq.seq_id)
            touched[req.request_id] = req
            if req.beam is not None:
                beam_rows.append((req, seq, i))
            elif req.params.n > 1 and len(req.samples) == 1 and not seq.output_token_ids:
                fanned = True
                for j in range(req.params.n):
                    gen = (
                        smp.generator
                        if j == 0
                        else self._isolated(req, self._fork_generator, req, j)
                    )
                    plan.append(PlanRow(req, smp, j, i, gen))
            else:
                plan.append(PlanRow(req, smp, 0, i, smp.generator))
                argmax_only = argmax_only and req.params.argmax_only
            i += 1
        straight = not fanned and not beam_rows
        if argmax_only and straight:
            ids = self._argmax(logits, len(plan))
            tokens: list[Sampled] = [Sampled(t, None, None) for t in ids]
        else:
            tokens = self._sample(logits, plan)
        primary = {
            smp.seq.seq_id: tok
            for (req, smp, j, _, _), (tok, _, _) in zip(plan, tokens, strict=True)
            if j == 0 and req.error is None
        }
        self.scheduler.update(out, primary)  # a failed request's sequences are finished: skipped

        if fanned:
            self._emit_fanned(plan, tokens)
        else:
            # One row per request: nothing later in the step touches a request once its row is
            # emitted, so it is reported in the same pass.
            one_pass = straight and len(touched) == len(plan)
            emit, report = self._emit_token, self._output
            reports = []
            for (req, smp, _, _, _), (tok, lp, top) in zip(plan, tokens, strict=True):
                if req.error is None:
                    try:
                        emit(req, smp, tok, lp, top)
                    except Exception as exc:
                        self._fail(req, exc)
                if one_pass:
                    reports.append(report(req))
            if one_pass:
                return reports
        for req, seq, i in beam_rows:
            if req.error is None and req.request_id in self.requests:
                self._isolated(req, self._beam_logits, req, seq, logits[i])
        return [self._output(req) for req in touched.values()]

    def _record_prompt_logprobs(self, spans: list[PromptLogitSpan], logits: torch.Tensor) -> None:
        """Append the prompt logprobs these rows give, for positions not recorded yet (a
        recomputed prompt computes them again)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        row = 0
        for span in spans:
            req, _ = self.requests.owner(span.seq.seq_id)
            rows = logprobs[row : row + span.rows]
            row += span.rows
            self._isolated(req, _append_prompt_logprobs, req, span, rows)

    def _step_plain_greedy(self, out: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        """The rest of a step in which every live request is one plain greedy stream (the common
        serving case, and where per-sequence costs add up): one argmax for the batch, no
        sampling plan, and each request is emitted and reported in one pass."""
        flags = out.samples
        seqs = out.seqs if all(flags) else list(compress(out.seqs, flags))
        ids = self._argmax(logits, len(seqs)) if seqs else []
        if len(seqs) == len(out.seqs):
            tokens: list[int | None] = ids  # type: ignore[assignment]  # invariance of list
        else:  # some sequences only computed a prefill chunk
            chosen = iter(ids)
            tokens = [next(chosen) if f else None for f in flags]
        self.scheduler.advance(out, tokens)
        owner, emit, report = self.requests.owner, self._emit_token, self._output_single
        reports = []
        for seq, tok in zip(seqs, ids, strict=True):
            req, smp = owner(seq.seq_id)
            try:
                emit(req, smp, tok, None, None)
            except Exception as exc:
                self._fail(req, exc)
            reports.append(report(req, smp))
        return reports

    def _emit_fanned(self, plan: list[PlanRow], tokens: list[Sampled]) -> None:
        """Per request: fork every new sample before any stop check can finish (and free) its
        parent, then emit the tokens. A request with one row skips the grouping."""
        by_request: dict[str, list[int]] = {}
        for k, (req, smp, j, _, _) in enumerate(plan):
            if j == 0 and (k + 1 == len(plan) or plan[k + 1].sample_index == 0):
                if req.error is None:
                    tok, lp, top = tokens[k]
                    self._isolated(req, self._emit_token, req, smp, tok, lp, top)
            else:
                by_request.setdefault(req.request_id, []).append(k)
        for ks in by_request.values():
            req = plan[ks[0]].request
            if req.error is None:
                self._isolated(req, self._apply_rows, req, [(plan[k], tokens[k]) for k in ks])

    def _isolated(self, req: Request, fn: Callable[..., _T], *args: object) -> _T | None:
        """``fn(*args)``, failing only ``req`` (not the batch) if it raises."""
        if req.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self._fail(req, exc)
            return None

    def _fail(self, req: Request, exc: BaseException) -> None:
        logger.error("request %s failed: %r", req.request_id, exc, exc_info=exc)
        self.requests.fail(req, f"internal error while generating: {type(exc).__name__}: {exc}")

    def _argmax(self, logits: torch.Tensor, num_rows: int) -> list[int]:
        """Plain greedy rows, plan row k = logits row k: one argmax over the batch. Nothing here
        depends on one request, so a failure is the batch's (it propagates)."""
        if logits.shape[0] != num_rows:
            raise ValueError(f"{logits.shape[0]} logit rows for {num_rows} sampling rows")
        ids: list[int] = greedy_tokens(logits).tolist()
        return ids

    def _sample(self, logits: torch.Tensor, plan: list[PlanRow]) -> list[Sampled]:
        """(token, its logprob, top logprobs) per planned row, sampled as one batch. If the batch
        raises, each request's rows are sampled alone and only the requests that still raise
        fail (their rows get token 0, never used). A request whose generator advanced in the
        failed batched attempt draws differently in that one step."""
        rows = [
            SampleRow(
                req.params,
                gen,
                smp.seq.output_token_ids,
                req.prompt_token_ids,
                req.stop_ids,
                req.bad_words,
            )
            for req, smp, _, _, gen in plan
        ]
        live = [k for k, (req, _, _, _, _) in enumerate(plan) if req.error is None]
        results: list[Sampled] = [_NOTHING] * len(plan)
        if not live:
            return results
        # Structured outputs: one batched bitmask for every constrained row (a row forked this
        # step masks with its parent's matcher: both stand at the first token).
        constrained = [k for k in live if plan[k].sample.grammar is not None]
        if constrained:
            bitmask = matchers.fill_bitmask(
                [plan[k].sample.grammar for k in constrained], self.vocab_size
            )
            for g, k in enumerate(constrained):
                rows[k].token_mask = bitmask[g]
        try:
            _scatter(
                results,
                live,
                sample(logits[[plan[k].logits_row for k in live]], [rows[k] for k in live]),
            )
            return results
        except Exception:
            logger.warning("batched sampling raised; sampling each request alone", exc_info=True)
        groups: dict[str, list[int]] = {}
        for k in live:
            groups.setdefault(plan[k].request.request_id, []).append(k)
        for ks in groups.values():
            req = plan[ks[0]].request
            rows_k = [rows[k] for k in ks]
            idx = [plan[k].logits_row for k in ks]
            result = self._isolated(req, sample, logits[idx], rows_k)
            if result is not None:
                _scatter(results, ks, result)
        return results

    def _apply_rows(
        self,
        req: Request,
        rows: list[tuple[PlanRow, Sampled]],
    ) -> None:
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
            self._emit_token(req, stream, tok, lp, top)

    def _fork_generator(self, req: Request, j: int) -> torch.Generator | None:
        """Sample ``j``'s own RNG: ``seed + j`` when seeded (reproducible whatever the batch),
        else drawn from the engine's RNG. Greedy samples need none."""
        if req.params.greedy or req.beam is not None:
            return None
        seed = req.params.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._rng))
        # manual_seed takes [-2**63, 2**64 - 1]; SamplingParams keeps seed an int64 and n small.
        return torch.Generator(device=self.device).manual_seed(seed + j)

    def _emit_token(
        self,
        req: Request,
        smp: Sample,
        token: int,
        logprob: float | None,
        top: dict[int, float] | None,
    ) -> None:
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

    def _output_single(self, req: Request, smp: Sample) -> RequestOutput:
        """``_output`` of a single-stream request, given its sample: it reads the sample's state
        directly instead of through ``Request.finished`` (a failed request's sample is finished
        with "abort", so ``error`` needs no test here)."""
        finished = smp.finish_reason is not None
        if finished:
            self.requests.remove(req)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, [_report(smp, finished)], finished,
            req.error, smp.seq.num_cached_tokens, req.prompt_logprobs,
        )  # fmt: skip

    def _output(self, req: Request) -> RequestOutput:
        """This step's report of ``req`` (removing it from the table once finished). Runs once
        per request per step."""
        if req.single:
            return self._output_single(req, req.samples[0])
        finished = req.finished
        if finished:
            self.requests.remove(req)
        if req.beam is not None:
            outputs = beam_search.outputs(self.tokenizer, req.beam) if finished else []
        else:
            outputs = [_report(s, finished) for s in sorted(req.samples, key=_index)]
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


def _append_prompt_logprobs(req: Request, span: PromptLogitSpan, logprobs: torch.Tensor) -> None:
    """``logprobs`` [span.rows, vocab]: row k predicts prompt token ``span.first + k + 1``."""
    recorded = req.prompt_logprobs
    assert recorded is not None
    skip = len(recorded) - (span.first + 1)  # rows whose positions are already recorded
    if skip >= span.rows:
        return
    rows = logprobs[max(skip, 0) :]
    targets = req.prompt_token_ids[span.first + 1 + max(skip, 0) : span.first + 1 + span.rows]
    ids = torch.tensor(targets, device=rows.device).unsqueeze(1)
    chosen = rows.gather(1, ids).squeeze(1).tolist()
    k = req.params.prompt_logprobs or 0
    top_values, top_ids = rows.topk(k) if k else (None, None)
    for n, (token, lp) in enumerate(zip(targets, chosen, strict=True)):
        entry = {token: lp}
        if top_values is not None and top_ids is not None:
            entry.update(zip(top_ids[n].tolist(), top_values[n].tolist(), strict=True))
        recorded.append(entry)


def _not_token(t: object, vocab_size: int) -> bool:
    return not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size


def _scatter(
    results: list[Sampled],
    where: list[int],
    result: SampleResult,
) -> None:
    for n, k in enumerate(where):
        lp = result.logprobs[n] if result.logprobs is not None else None
        top = result.top_logprobs[n] if result.top_logprobs is not None else None
        results[k] = Sampled(result.token_ids[n], lp, top)


def _report(smp: Sample, finished: bool) -> CompletionOutput:
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
