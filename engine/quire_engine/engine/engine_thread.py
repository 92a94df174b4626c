"""The engine thread: the one thread that owns the ``LLMEngine``, and the command queue through
which the event loop (``async_engine.AsyncEngine``) talks to it.

Ownership: :class:`EngineThread` creates the ``LLMEngine`` (load + warm-up) on its thread and is
the only caller of ``add_request``, ``step``, ``abort_request`` and the only reader of the
scheduler; it also owns the ``StatsRecorder`` (metrics). Between two steps it applies every
queued :data:`Command`, so an abort lands before the next step starts. It never touches the
event loop's state: it hands results over through the :class:`LoopCallbacks` it was given, with
``call_soon_threadsafe``. The fields it publishes (``state``, ``info``, ``steps``,
``num_waiting``, the watchdog's ``last_progress`` and ``idle``) are single assignments the event
loop reads; the event loop writes only ``hung`` and ``state`` (the watchdog giving up on a step).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

from quire_engine.core.config import EngineConfig
from quire_engine.core.lora import LoRARequest
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.metrics import EngineFacts, ServerMetrics
from quire_engine.engine.recorder import StatsRecorder
from quire_engine.engine.request_handle import EngineUnavailable
from quire_engine.engine.startup import StartupPhase
from quire_engine.model.lora_files import LoRAWeights
from quire_engine.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0  # while idle, how often the engine thread checks the tensor-parallel ranks


class EngineState(enum.Enum):
    LOADING = "loading"  # the thread is loading the model or warming up
    READY = "ready"
    DEAD = "dead"  # load or a step raised; the thread is gone
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Published by the engine thread once the model is ready. ``tokenizer`` is a private copy for
    the event loop (tokenizing prompts, chat templates), so the two threads never share one."""

    model_name: str
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase
    # generation_config.json's sampling values, for request fields left unset.
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    vocab_size: int = 0  # the model's (token ids must be below it)
    # Structured outputs: the engine's compiled grammars (compile() is thread-safe).
    grammars: GrammarCache | None = None
    kv_cache_dtype: str = "auto"  # what the KV pool stores (--kv-cache-dtype, canonical name)
    # LoRA (None: enable_lora is off): reads and checks an adapter on any thread, for
    # ``AdapterCommand`` to insert on the engine thread.
    lora_loader: Callable[[LoRARequest], LoRAWeights] | None = None
    max_loras: int = 0


@dataclass(slots=True)
class Add:
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrival: float  # time.monotonic() when the HTTP request arrived
    future: asyncio.Future[None]
    beam_width: int | None = None  # beam search of this width instead of sampling
    cache_salt: str | None = None  # isolates the request's prefix-cache entries
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class AdapterOp(enum.Enum):
    LOAD = "load"  # serve ``weights`` (loaded off the step loop)
    UNLOAD = "unload"  # once no unfinished request uses ``lora_id``, forget it


@dataclass(slots=True)
class AdapterCommand:
    op: AdapterOp
    future: asyncio.Future[None]
    weights: LoRAWeights | None = None
    lora_id: int = 0


@dataclass(slots=True)
class Abort:
    request_ids: list[str]
    asked_at_step: int


class Stop:
    pass


Command = Add | Abort | AdapterCommand | Stop  # what the event loop asks of the engine thread

# An answer to one submit: its future and the error it failed with (None: queued).
Resolution = tuple[asyncio.Future[None], Exception | None]


class LoopCallbacks(NamedTuple):
    """What the engine thread posts to the event loop (each runs there, never on the thread),
    and the one callback it makes from its own thread."""

    deliver: Callable[[list[RequestOutput]], None]  # a step's outputs, to their requests
    resolve: Callable[[list[Resolution]], None]  # answers to submits
    fail_all: Callable[[EngineUnavailable], None]  # end every open request (a clean stop)
    die: Callable[[EngineUnavailable], None]  # the engine is gone: refuse everything
    report_death: Callable[[], None]  # called on the engine thread itself, once it died


class EngineThread:
    """The engine thread and its command queue (see the module docstring). ``factory`` builds
    the engine on the thread; ``start`` runs it."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: ServerMetrics,
        factory: Callable[[EngineConfig], LLMEngine],
        callbacks: LoopCallbacks,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._factory = factory
        self._callbacks = callbacks
        # Written by the engine thread, read by the event loop (single assignments).
        self.state = EngineState.LOADING
        self.info: ModelInfo | None = None
        self.steps = 0
        self.max_abort_lag_steps = 0  # steps run between an abort request and its application
        self.num_waiting = 0
        # Watchdog: when the engine thread last made progress, and whether it is idle (blocked
        # waiting for a command, so no progress is due).
        self.last_progress = time.monotonic()
        self.idle = True
        self.hung = False  # set by the watchdog; the engine thread stops after its step
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Unloads waiting for the requests in flight on their adapter to finish.
        self._unloads: list[AdapterCommand] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start loading on a new thread; results go to ``loop``."""
        self._loop = loop
        self._thread = threading.Thread(target=self._main, name="quire-engine", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)

    def _post(self, fn: Callable[[Any], None], arg: object) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: then nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, arg)

    def _main(self) -> None:
        engine: LLMEngine | None = None
        recorder: StatsRecorder | None = None
        started = time.monotonic()
        try:
            engine = self._factory(self.config)
            with engine.startup.phase(StartupPhase.WARMUP):
                _warm_up(engine)
            tokenizer = copy.deepcopy(engine.tokenizer)
            lora = engine.runner.lora
            if lora is not None:
                lora.autoload = False  # adapters come loaded, through AdapterCommand
            self.info = ModelInfo(
                engine.model_name,
                engine.max_model_len,
                tokenizer,
                engine.sampling_defaults,
                engine.vocab_size,
                engine.grammars,
                engine.scheduler.cache_config.kv_cache_dtype.value,
                lora.load if lora is not None else None,
                lora.config.max_loras if lora is not None else 0,
            )
            engine.startup.ready()
            recorder = StatsRecorder(self.metrics, engine.scheduler.stats(), EngineFacts.of(engine))
            if lora is not None:
                recorder.adapters(lora.config.max_loras, lora.names)
            self.state = EngineState.READY
            logger.info(
                "engine ready in %.1f s (load + warm-up): model %s, max_model_len %d",
                time.monotonic() - started,
                engine.model_name,
                engine.max_model_len,
            )
            self._serve(engine, recorder)
            if not self.hung:  # a hung engine stays dead even if its step came back
                self.state = EngineState.STOPPED
        except BaseException:
            self.state = EngineState.DEAD
            logger.exception("the engine loop died")
            self._callbacks.report_death()
        finally:
            self._shut_down(engine, recorder)

    def _serve(self, engine: LLMEngine, recorder: StatsRecorder) -> None:
        while self._apply_commands(engine, recorder, block=not engine.has_unfinished()):
            if self.hung:  # the watchdog gave up on this engine while the step ran
                return
            if not engine.has_unfinished():
                continue
            start = time.monotonic()
            outputs = engine.step()
            end = time.monotonic()
            self.last_progress = end
            self.steps += 1
            if not outputs and not engine.scheduler.has_unfinished():
                raise RuntimeError("engine stalled: requests left but nothing to schedule")
            recorder.step(outputs, start, end, engine.scheduler.stats())
            self.num_waiting = engine.scheduler.num_waiting
            if outputs:
                self._post(self._callbacks.deliver, outputs)
            if self._unloads:
                self._finish_unloads(engine, recorder)

    def _apply_commands(self, engine: LLMEngine, recorder: StatsRecorder, *, block: bool) -> bool:
        """Apply every queued command (waiting for one if ``block``); False once told to stop."""
        try:
            if block:
                self.idle = True  # nothing pending: no progress is due while blocked
                command = self._next_command(engine)
                self.last_progress = time.monotonic()
                self.idle = False
            else:
                command = self.commands.get_nowait()
        except queue.Empty:
            return True
        resolutions: list[Resolution] = []
        keep_going = True
        while True:
            if isinstance(command, Stop):
                keep_going = False  # later commands are failed by _shut_down
                break
            if isinstance(command, Add):
                resolutions.append((command.future, self._add(engine, recorder, command)))
            elif isinstance(command, AdapterCommand):
                if command.op is AdapterOp.UNLOAD:
                    self._unloads.append(command)  # answered by _finish_unloads
                else:
                    resolutions.append((command.future, self._load(engine, recorder, command)))
            else:
                self._apply_abort(engine, recorder, command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
        recorder.refresh(engine.scheduler.stats())
        # Publish the queue depth before the submitters learn their request was queued, so that
        # admission control never counts a request neither as pending nor as waiting.
        self.num_waiting = engine.scheduler.num_waiting
        if resolutions:
            self._post(self._callbacks.resolve, resolutions)
        if self._unloads:
            self._finish_unloads(engine, recorder)
        return keep_going

    def _load(
        self, engine: LLMEngine, recorder: StatsRecorder, command: AdapterCommand
    ) -> Exception | None:
        assert command.weights is not None
        try:
            engine.add_adapter(command.weights)
        except ValueError as exc:
            return exc
        lora = engine.runner.lora
        assert lora is not None
        recorder.adapters(lora.config.max_loras, lora.names)
        return None

    def _finish_unloads(self, engine: LLMEngine, recorder: StatsRecorder) -> None:
        """Unload every adapter waiting to be unloaded that no unfinished request uses now (the
        server stopped sending it requests when the unload was asked)."""
        done = [u for u in self._unloads if not engine.adapter_in_use(u.lora_id)]
        if not done:
            return
        self._unloads = [u for u in self._unloads if u not in done]
        resolutions: list[Resolution] = []
        for command in done:
            engine.remove_adapter(command.lora_id)
            resolutions.append((command.future, None))
        lora = engine.runner.lora
        if lora is not None:
            recorder.adapters(lora.config.max_loras, lora.names)
        self._post(self._callbacks.resolve, resolutions)

    def _next_command(self, engine: LLMEngine) -> Command:
        """Wait for a command, checking the engine's health (its tensor-parallel ranks) every
        ``HEALTH_POLL_S`` meanwhile: a rank that died while idle kills the engine now, not at
        the next request."""
        while True:
            try:
                return self.commands.get(timeout=HEALTH_POLL_S)
            except queue.Empty:
                engine.check_health()

    def _add(self, engine: LLMEngine, recorder: StatsRecorder, command: Add) -> Exception | None:
        added: list[str] = []
        try:
            for rid, prompt, params in zip(
                command.request_ids, command.prompts, command.params, strict=True
            ):
                engine.add_request(
                    rid,
                    prompt,
                    params,
                    cache_salt=command.cache_salt,
                    beam_width=command.beam_width,
                    lora_request=command.lora_request,
                )
                added.append(rid)
        except Exception as exc:  # ValueError: bad input (400); anything else: a bug (500)
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", command.request_ids[0])
            for rid in added:  # all prompts of a request or none
                engine.abort_request(rid)
            return exc
        lora = command.lora_request.lora_name if command.lora_request is not None else None
        for rid, prompt, params in zip(added, command.prompts, command.params, strict=True):
            recorder.added(rid, len(prompt), params, command.arrival, lora)
        return None

    def _apply_abort(self, engine: LLMEngine, recorder: StatsRecorder, command: Abort) -> None:
        now = time.monotonic()
        for rid in command.request_ids:
            if recorder.is_live(rid):
                self.max_abort_lag_steps = max(
                    self.max_abort_lag_steps, self.steps - command.asked_at_step
                )
                engine.abort_request(rid)
                recorder.aborted(rid, now)

    def _shut_down(self, engine: LLMEngine | None, recorder: StatsRecorder | None) -> None:
        """Whatever ended the loop: free every block, fail every waiter."""
        if engine is not None and recorder is not None:
            now = time.monotonic()
            try:
                for rid in engine.requests.ids():
                    engine.abort_request(rid)
                    recorder.aborted(rid, now)
                recorder.refresh(engine.scheduler.stats())
            except Exception:  # a step died half-way; the state may be inconsistent
                logger.exception("could not abort the remaining requests")
        if engine is not None:
            engine.close()  # tensor-parallel workers stop with the engine
        stopped = self.state is EngineState.STOPPED
        error = EngineUnavailable(
            "the server is shutting down" if stopped else "the engine loop died",
            code="shutting_down" if stopped else "engine_down",
            retry_after=5 if stopped else 30,
        )
        resolutions: list[Resolution] = [(u.future, error) for u in self._unloads]
        self._unloads = []
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add | AdapterCommand):
                resolutions.append((command.future, error))
        if resolutions:
            self._post(self._callbacks.resolve, resolutions)
        if stopped:
            self._post(self._callbacks.fail_all, error)
        elif not self.hung:  # the watchdog already answered everyone
            self._post(self._callbacks.die, error)


def _warm_up(engine: LLMEngine) -> None:
    """One short greedy request through the whole path before the server reports ready: on CUDA
    the first steps compile the Triton kernels, which must not land on a user's first request."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("quire-warmup", "warm up", params)
    while engine.has_unfinished():
        engine.step()
