"""The engine loop beside the event loop: one thread owns the ``LLMEngine``, the HTTP side talks to
it through a command queue and gets outputs back on the event loop.

Ownership:

* The engine thread (``quire-engine``) creates the ``LLMEngine`` (load + warmup) and is the only
  thread that ever calls ``add_request``, ``step``, ``abort_request`` or reads the scheduler. It
  also owns the ``StatsRecorder`` (metrics). Between two steps it applies every queued command, so
  an abort lands before the next step starts: a request is stopped at most one step after the
  abort was asked for, and ``abort_request`` returns its blocks to the pool at once.
* The event loop owns the routing table (engine request id -> the ``Sink`` of its HTTP request)
  and every ``Sink``. The engine thread never touches them: it hands results over with
  ``call_soon_threadsafe``.
* Whoever submits a request owns its ``RequestHandle`` and must call ``abort()`` when it stops
  listening (``abort()`` is a no-op once every output is final). The server does it in ``finally``
  blocks and when the client disconnects.
* Stopping the engine (``stop()``) aborts every live request, so the pool ends empty.

Failures:

* A request that fails on its own inside the engine (see ``LLMEngine``) arrives as a finished
  output with ``error`` set; ``RequestHandle.error`` keeps it for the server to report.
* If loading or a step raises, the engine is dead: every pending submit and every open handle is
  answered with ``EngineUnavailable`` (code ``engine_down``), later submits are refused at once,
  and ``on_death`` is called.
* A step that makes no progress for ``step_timeout`` seconds while work is pending is treated the
  same way (code ``engine_hung``; ``alive`` turns False, so ``/health`` answers 503): a watchdog
  task on the event loop checks it. If the step ever returns, the thread stops.
* Draining (``begin_drain``, on SIGTERM): no new request is admitted (code ``shutting_down``) while
  the live ones go on; ``fail_open`` ends those still open at the deadline.

Outputs are cumulative (text and tokens so far), so a consumer slower than the engine loses
nothing when only the latest output per prompt is kept: a slow client gets bigger deltas instead
of an unbounded queue.
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
from typing import Any

from transformers import PreTrainedTokenizerBase

from quire_engine.core.config import EngineConfig
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.metrics import EngineFacts, ServerMetrics
from quire_engine.engine.recorder import StatsRecorder
from quire_engine.engine.request_handle import EngineUnavailable, RequestHandle, Sink
from quire_engine.engine.startup import StartupPhase
from quire_engine.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0  # while idle, how often the engine thread checks the tensor-parallel ranks

STOP_TIMEOUT_S = 30.0


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


@dataclass(slots=True)
class _Add:
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrival: float  # time.monotonic() when the HTTP request arrived
    future: asyncio.Future[None]
    beam_width: int | None = None  # beam search of this width instead of sampling
    cache_salt: str | None = None  # isolates the request's prefix-cache entries


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    asked_at_step: int


class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class AsyncEngine:
    """An ``LLMEngine`` on its own thread; ``submit`` from the event loop, iterate the handle.

    ``engine_factory`` builds the engine on that thread (tests inject slow or failing loads);
    ``on_death`` is called from that thread if loading or a step raises."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: ServerMetrics,
        *,
        max_waiting: int | None = None,
        step_timeout: float | None = None,
        engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine,
        on_death: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.step_timeout = step_timeout
        self._factory = engine_factory
        self._on_death = on_death
        self._death_reported = threading.Lock()
        self._died = False
        # Written by the engine thread, read by the event loop (single assignments).
        self.state = EngineState.LOADING
        self.info: ModelInfo | None = None
        self.steps = 0
        self.max_abort_lag_steps = 0  # steps run between an abort request and its application
        self._num_waiting = 0
        # Watchdog: when the engine thread last made progress, and whether it is idle (blocked
        # waiting for a command, so no progress is due).
        self._last_progress = time.monotonic()
        self._idle = True
        self._hung = False  # set by the watchdog; the engine thread stops after its step
        # Event loop only.
        self._routes: dict[str, tuple[Sink, int]] = {}
        self._pending_adds = 0
        self._submits: set[asyncio.Future[None]] = set()  # adds the engine has not answered yet
        self._failure: EngineUnavailable | None = None  # set once the engine died or hung
        self._draining = False
        self._watchdog: asyncio.Task[None] | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side -----------------------------------------------------------------
    def start(self) -> None:
        """Start loading on the engine thread; call from the event loop that will serve."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="quire-engine", daemon=True)
        self._thread.start()
        if self.step_timeout is not None:
            self._watchdog = self._loop.create_task(self._watch(self.step_timeout))

    async def stop(self) -> None:
        """Abort every request, end the thread, wait for it (bounded: a model still loading
        cannot be interrupted, and the thread is a daemon)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.0f s", STOP_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and (self.state in (EngineState.LOADING, EngineState.READY))
        )

    def not_ready(self) -> EngineUnavailable | None:
        """Why no request can be taken now; None once the model is loaded and warmed up."""
        if self._failure is not None:
            return self._failure
        if self._draining:
            return EngineUnavailable(
                "the server is shutting down", code="shutting_down", retry_after=5
            )
        if self.state is EngineState.LOADING:
            return EngineUnavailable("the model is still loading", code="not_ready", retry_after=5)
        if self.state is not EngineState.READY or self.info is None:
            return EngineUnavailable(
                "the engine is not running", code="engine_down", retry_after=30
            )
        return None

    def check_admission(self, num_prompts: int) -> ModelInfo:
        """Raise ``EngineUnavailable`` unless ``num_prompts`` more requests may queue now."""
        error = self.not_ready()
        if error is not None:
            raise error
        assert self.info is not None
        if self.max_waiting is not None:
            waiting = self._num_waiting + self._pending_adds
            if waiting + num_prompts > self.max_waiting:
                raise EngineUnavailable(
                    f"the server is overloaded: {waiting} requests are waiting "
                    f"(max_waiting={self.max_waiting})",
                    code="overloaded",
                    retry_after=1,
                )
        return self.info

    async def submit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        arrival: float | None = None,
        beam_width: int | None = None,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Queue one engine request per prompt; ``ValueError`` (nothing queued) for input the
        engine rejects, ``EngineUnavailable`` when it cannot take requests now."""
        self.check_admission(len(prompts))
        assert self._loop is not None  # check_admission passed, so start() ran
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        sink = Sink()
        for index, rid in enumerate(ids):
            self._routes[rid] = (sink, index)
        future: asyncio.Future[None] = self._loop.create_future()
        self._pending_adds += len(ids)
        # Registered on the event loop before the command is queued: if the engine dies before
        # answering it, _fail_all (also on the event loop) answers it instead.
        self._submits.add(future)
        self._commands.put(
            _Add(ids, prompts, params, arrival or time.monotonic(), future, beam_width, cache_salt)
        )
        try:
            await future
        except BaseException as exc:
            for rid in ids:
                self._routes.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError):
                # The add may still be applied: the abort queued behind it undoes it.
                self._commands.put(_Abort(ids, self.steps))
            raise
        finally:
            self._submits.discard(future)
            self._pending_adds -= len(ids)
        return RequestHandle(self.abort, ids, sink)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this engine serves (set by ``start``), for callers on other threads."""
        return self._loop

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet finished, aborted or failed (event loop)."""
        return len(self._routes)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (``/ready`` turns 503); live ones go on."""
        self._draining = True

    def fail_open(self, error: EngineUnavailable) -> None:
        """End every open request with ``error`` and abort it in the engine (event loop)."""
        self._fail_all(error)

    def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if live:
            self._commands.put(_Abort(live, self.steps))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted while the step ran
                continue
            if out.finished:
                del self._routes[out.request_id]
            sink, index = route
            sink.put(index, out)

    def _resolve(self, resolutions: list[tuple[asyncio.Future[None], Exception | None]]) -> None:
        for future, error in resolutions:
            if future.done():  # the submitter was cancelled
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _fail_all(self, error: Exception) -> None:
        """Answer every open handle and every unanswered submit with ``error`` (event loop)."""
        if self._routes:
            self._commands.put(_Abort(list(self._routes), self.steps))
        for sink, _ in list(self._routes.values()):
            sink.fail(error)
        self._routes.clear()
        for future in list(self._submits):
            if not future.done():
                future.set_exception(error)

    def _die(self, error: EngineUnavailable) -> None:
        """The engine is gone (event loop): answer everyone, refuse everything from now on."""
        self._failure = error
        self._fail_all(error)

    def _report_death(self) -> None:
        """Call ``on_death`` once, from whichever thread noticed first."""
        with self._death_reported:
            if self._died:
                return
            self._died = True
        if self._on_death is not None:
            self._on_death()

    # ---- watchdog (event loop) -----------------------------------------------------------
    def stalled_for(self) -> float:
        """Seconds the engine thread has been busy without progress (0 when idle or loading)."""
        if self._idle or self.state is not EngineState.READY:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress)

    def check_progress(self) -> None:
        """Declare the engine hung if a step has run longer than ``step_timeout``."""
        timeout = self.step_timeout
        if timeout is None or self._hung or self.state is not EngineState.READY:
            return
        stalled = self.stalled_for()
        if stalled <= timeout:
            return
        self._hung = True
        self.state = EngineState.DEAD
        logger.error(
            "the engine made no progress for %.0f s with work pending (step timeout %.0f s); "
            "failing every request and reporting unhealthy",
            stalled,
            timeout,
        )
        self._die(
            EngineUnavailable(
                f"the engine made no progress for {stalled:.0f} s",
                code="engine_hung",
                retry_after=30,
            )
        )
        self._report_death()

    async def _watch(self, timeout: float) -> None:
        interval = min(1.0, timeout / 4)
        while self.state in (EngineState.LOADING, EngineState.READY):
            await asyncio.sleep(interval)
            self.check_progress()

    def _post(self, fn: Callable[[Any], None], arg: object) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: then nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, arg)

    # ---- engine thread -------------------------------------------------------------------
    def _main(self) -> None:
        engine: LLMEngine | None = None
        recorder: StatsRecorder | None = None
        started = time.monotonic()
        try:
            engine = self._factory(self.config)
            with engine.startup.phase(StartupPhase.WARMUP):
                _warm_up(engine)
            tokenizer = copy.deepcopy(engine.tokenizer)
            self.info = ModelInfo(
                engine.model_name,
                engine.max_model_len,
                tokenizer,
                engine.sampling_defaults,
                engine.vocab_size,
                engine.grammars,
            )
            engine.startup.ready()
            recorder = StatsRecorder(self.metrics, engine.scheduler.stats(), EngineFacts.of(engine))
            self.state = EngineState.READY
            logger.info(
                "engine ready in %.1f s (load + warm-up): model %s, max_model_len %d",
                time.monotonic() - started,
                engine.model_name,
                engine.max_model_len,
            )
            self._serve(engine, recorder)
            if not self._hung:  # a hung engine stays dead even if its step came back
                self.state = EngineState.STOPPED
        except BaseException:
            self.state = EngineState.DEAD
            logger.exception("the engine loop died")
            self._report_death()
        finally:
            self._shut_down(engine, recorder)

    def _serve(self, engine: LLMEngine, recorder: StatsRecorder) -> None:
        while self._apply_commands(engine, recorder, block=not engine.has_unfinished()):
            if self._hung:  # the watchdog gave up on this engine while the step ran
                return
            if not engine.has_unfinished():
                continue
            start = time.monotonic()
            outputs = engine.step()
            end = time.monotonic()
            self._last_progress = end
            self.steps += 1
            if not outputs and not engine.scheduler.has_unfinished():
                raise RuntimeError("engine stalled: requests left but nothing to schedule")
            recorder.step(outputs, start, end, engine.scheduler.stats())
            self._num_waiting = engine.scheduler.num_waiting
            if outputs:
                self._post(self._deliver, outputs)

    def _apply_commands(self, engine: LLMEngine, recorder: StatsRecorder, *, block: bool) -> bool:
        """Apply every queued command (waiting for one if ``block``); False once told to stop."""
        try:
            if block:
                self._idle = True  # nothing pending: no progress is due while blocked
                command = self._next_command(engine)
                self._last_progress = time.monotonic()
                self._idle = False
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        resolutions: list[tuple[asyncio.Future[None], Exception | None]] = []
        keep_going = True
        while True:
            if isinstance(command, _Stop):
                keep_going = False  # later commands are failed by _shut_down
                break
            if isinstance(command, _Add):
                resolutions.append((command.future, self._add(engine, recorder, command)))
            else:
                self._apply_abort(engine, recorder, command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        recorder.refresh(engine.scheduler.stats())
        # Publish the queue depth before the submitters learn their request was queued, so that
        # admission control never counts a request neither as pending nor as waiting.
        self._num_waiting = engine.scheduler.num_waiting
        if resolutions:
            self._post(self._resolve, resolutions)
        return keep_going

    def _next_command(self, engine: LLMEngine) -> Any:
        """Wait for a command, checking the engine's health (its tensor-parallel ranks) every
        ``HEALTH_POLL_S`` meanwhile: a rank that died while idle kills the engine now, not at
        the next request."""
        while True:
            try:
                return self._commands.get(timeout=HEALTH_POLL_S)
            except queue.Empty:
                engine.check_health()

    def _add(self, engine: LLMEngine, recorder: StatsRecorder, command: _Add) -> Exception | None:
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
                )
                added.append(rid)
        except Exception as exc:  # ValueError: bad input (400); anything else: a bug (500)
            if not isinstance(exc, ValueError):
                logger.exception("adding request %s failed", command.request_ids[0])
            for rid in added:  # all prompts of a request or none
                engine.abort_request(rid)
            return exc
        for rid, prompt, params in zip(added, command.prompts, command.params, strict=True):
            recorder.added(rid, len(prompt), params, command.arrival)
        return None

    def _apply_abort(self, engine: LLMEngine, recorder: StatsRecorder, command: _Abort) -> None:
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
        resolutions: list[tuple[asyncio.Future[None], Exception | None]] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                resolutions.append((command.future, error))
        if resolutions:
            self._post(self._resolve, resolutions)
        if stopped:
            self._post(self._fail_all, error)
        elif not self._hung:  # the watchdog already answered everyone
            self._post(self._die, error)


def _warm_up(engine: LLMEngine) -> None:
    """One short greedy request through the whole path before the server reports ready: on CUDA
    the first steps compile the Triton kernels, which must not land on a user's first request."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("quire-warmup", "warm up", params)
    while engine.has_unfinished():
        engine.step()
