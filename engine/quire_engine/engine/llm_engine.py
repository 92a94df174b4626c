"""The synchronous engine: requests in, one step (schedule, execute, sample, update, process) per
call, outputs out.

``LLMEngine`` owns the parts its build made (``engine/build``): the scheduler (control side), the
model runner (tensor side), the request table (every request's sampling state), the grammar
cache and the RNG of unseeded samples. ``step()`` is the loop; what a step does with its logits
is one ``StepBatch`` per path (``engine/step_batch``), the tokens are drawn beside the sampler
(``model/row_sampling``), and emission, stop checks, forks and the reports are the output stage
(``engine/output_processor``). The offline ``LLM`` and the async server are thin layers over it.

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

Observers (``engine/observer``): instrumentation added with ``add_observer`` is called after each
step with its schedule and CPU time; without one, a step reads no clock.
"""

from __future__ import annotations

import time
import weakref
from functools import partial

import torch

from quire_engine.core import beam_search
from quire_engine.core.config import EngineConfig
from quire_engine.core.lora import BASE, LoRARequest
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.request_table import Request
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.scheduler import SchedulerOutput, prompt_logit_spans
from quire_engine.core.sequence import Sequence
from quire_engine.engine.build import EngineParts, build, check_placement
from quire_engine.engine.observer import StepObserver, StepRecord
from quire_engine.engine.output_processor import OutputProcessor
from quire_engine.engine.prompt_logprobs import PromptLogprobs
from quire_engine.engine.startup import StartupTimes
from quire_engine.engine.step_batch import GreedyBatch, PlannedBatch, StepBatch
from quire_engine.model.lora_files import LoRAWeights
from quire_engine.model.sampler import greedy_tokens, sample
from quire_engine.structured import matchers

__all__ = ["LLMEngine", "check_placement"]

_clock = time.thread_time_ns


class LLMEngine:
    def __init__(self, config: EngineConfig, startup: StartupTimes | None = None) -> None:
        """``startup``: the recorder of this engine's start-up phases (default: one counting
        from now; ``serve`` passes one counting from process start)."""
        self.config = config
        self.startup = startup if startup is not None else StartupTimes()
        parts: EngineParts = build(config, self.startup)
        self.device, self.dtype, self.parallel = parts.device, parts.dtype, parts.parallel
        # The workers stop with the engine, even one never closed (or at interpreter exit).
        self._stop_workers = weakref.finalize(self, self.parallel.close) if self.parallel else None
        self.model_name = parts.model_name
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.sampling_defaults = parts.sampling_defaults
        self.vocab_size = parts.vocab_size
        self.max_model_len = parts.max_model_len
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.requests = parts.requests
        self.grammars = parts.grammars
        self._rng = parts.rng
        self.output_processor = OutputProcessor(
            self.requests, self.scheduler, self.tokenizer, self.eos_token_ids
        )
        self._prompt_logprobs = PromptLogprobs(self.output_processor)
        self._bitmask = partial(matchers.fill_bitmask, vocab_size=self.vocab_size)
        self._observers: tuple[StepObserver, ...] = ()

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ``ValueError`` for bad input or one that cannot fit. Transactional:
        everything is validated and built first, and a rejection leaves the request table and
        the scheduler exactly as they were (an adapter loaded for it stays loaded: a cache).
        ``lora_request``: the adapter it runs with (needs ``enable_lora``)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams; got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        width = self._check_fit(params, beam_width)
        text, ids = self.tokenize(prompt)
        lora_id = self._adapter(lora_request)
        lora_path = lora_request.lora_path if lora_request is not None else ""
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
            lora_id=lora_id,
            lora_path=lora_path,
            reserved_seqs=width,
            prompt_logits=params.prompt_logprobs is not None,
        )
        first = self.requests.new_sample(req, seq, 0, self._fork_generator(req, 0))
        if compiled is not None:
            first.grammar = matchers.new_matcher(compiled)
        self.requests.add(req, first)  # the scheduler's checks; nothing changed if it raises
        if req.beam is not None:
            req.beam.active.append(seq.seq_id)

    def add_adapter(self, weights: LoRAWeights) -> None:
        """Serve an adapter loaded off the step loop (``LoRAModel.load``); ``ValueError`` if LoRA
        is off or its id belongs to another adapter."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("enable_lora is off")
        lora.insert(weights)

    def adapter_in_use(self, lora_id: int) -> bool:
        """Whether an unfinished sequence runs with the adapter."""
        return any(seq.lora_id == lora_id for seq in self.scheduler.seqs.values())

    def remove_adapter(self, lora_id: int) -> bool:
        """Forget an adapter no sequence uses (``adapter_in_use`` first); False if unknown."""
        if self.adapter_in_use(lora_id):
            raise ValueError(f"LoRA adapter {lora_id} is in use")
        return self.runner.lora is not None and self.runner.lora.remove(lora_id)

    def _adapter(self, request: LoRARequest | None) -> int:
        """The lora id a request runs with (0: the base model), its adapter loaded."""
        if request is None:
            return BASE
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest; got {type(request).__name__}")
        lora = self.runner.lora
        if lora is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} asked for; enable_lora is off")
        lora.add(request)
        return request.lora_int_id

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

    # ---- observers -----------------------------------------------------------------------
    def add_observer(self, observer: StepObserver) -> None:
        """Call ``observer.on_step`` after every step from now on (on the stepping thread)."""
        self._observers = (*self._observers, observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop calling ``observer`` (unknown observers are ignored)."""
        self._observers = tuple(o for o in self._observers if o is not observer)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward pass; outputs of the requests that progressed
        (including those that failed in this step, finished with ``error``)."""
        started = _clock() if self._observers else None
        out = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if not out.is_empty:
            logits = self._execute(out)  # [sampling rows, vocab]
            batch = self._batch(out)
            # The kernels are read from this module per step: bench step and tests wrap them.
            batch.sample(logits, sample, greedy_tokens)
            batch.update(self.scheduler)
            outputs = batch.process()
        if started is not None:
            self._notify(StepRecord(out, _clock() - started))
        return outputs

    def _execute(self, out: SchedulerOutput) -> torch.Tensor:
        """The forward: logits of the sampling rows (prompt logprobs' rows recorded apart)."""
        spans = prompt_logit_spans(out) if self.requests.num_prompt_logprobs else []
        try:
            logits = self.runner.execute(out, spans) if spans else self.runner.execute(out)
        except Exception as exc:
            if self.parallel is not None:
                self.parallel.blame(exc)  # name the rank that died, if one did
            raise
        return self._prompt_logprobs.split(spans, logits) if spans else logits

    def _batch(self, out: SchedulerOutput) -> StepBatch:
        """The step's path: the plain greedy lane when every live request is one plain greedy
        stream, else the planned rows."""
        if self.requests.all_plain_greedy:
            return GreedyBatch(out, self.output_processor)
        return PlannedBatch(out, self.output_processor, self._fork_generator, self._bitmask)

    def _notify(self, record: StepRecord) -> None:
        for observer in self._observers:
            observer.on_step(record)

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


def _not_token(t: object, vocab_size: int) -> bool:
    return not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
