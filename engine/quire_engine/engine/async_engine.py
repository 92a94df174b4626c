"""The engine loop beside the event loop: one thread owns the ``LLMEngine``, the HTTP side talks to
it through a command queue and gets outputs back on the event loop. This module is the event
loop's side (``AsyncEngine``); the thread and its commands are :mod:`.engine_thread`.

Ownership:

* The engine thread (``quire-engine``, :mod:`.engine_thread`) creates the ``LLMEngine`` (load +
  warmup) and is the only thread that ever calls ``add_request``, ``step``, ``abort_request`` or
  reads the scheduler. It also owns the ``StatsRecorder`` (metrics). Between two steps it applies
  every queued command, so an abort lands before the next step starts: a request is stopped at
  most one step after the abort was asked for, and ``abort_request`` returns its blocks to the
  pool at once.
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
import logging
import threading
import time
from collections.abc import Callable

from quire_engine.core.config import EngineConfig
from quire_engine.core.lora import LoRARequest
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.engine_thread import (
    Abort,
    AdapterCommand,
    AdapterOp,
    Add,
    EngineState,
    EngineThread,
    LoopCallbacks,
    ModelInfo,
    Resolution,
    Stop,
)
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.metrics import ServerMetrics
from quire_engine.engine.request_handle import EngineUnavailable, RequestHandle, Sink

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


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
        self._on_death = on_death
        self._death_reported = threading.Lock()
        self._died = False
        callbacks = LoopCallbacks(
            self._deliver, self._resolve, self._fail_all, self._die, self._report_death
        )
        self._worker = EngineThread(config, metrics, engine_factory, callbacks)
        # Event loop only.
        self._routes: dict[str, tuple[Sink, int]] = {}
        self._pending_adds = 0
        self._submits: set[asyncio.Future[None]] = set()  # adds the engine has not answered yet
        self._failure: EngineUnavailable | None = None  # set once the engine died or hung
        self._draining = False
        self._watchdog: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- what the engine thread publishes ------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._worker.state

    @property
    def info(self) -> ModelInfo | None:
        """The model's facts, once the engine thread loaded it (None before)."""
        return self._worker.info

    @property
    def steps(self) -> int:
        """Engine steps run so far."""
        return self._worker.steps

    @property
    def max_abort_lag_steps(self) -> int:
        """The most steps run between an abort request and its application."""
        return self._worker.max_abort_lag_steps

    # ---- event-loop side -----------------------------------------------------------------
    def start(self) -> None:
        """Start loading on the engine thread; call from the event loop that will serve."""
        self._loop = asyncio.get_running_loop()
        self._worker.start(self._loop)
        if self.step_timeout is not None:
            self._watchdog = self._loop.create_task(self._watch(self.step_timeout))

    async def stop(self) -> None:
        """Abort every request, end the thread, wait for it (bounded: a model still loading
        cannot be interrupted, and the thread is a daemon)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if not self._worker.started:
            return
        self._worker.commands.put(Stop())
        await asyncio.to_thread(self._worker.join, STOP_TIMEOUT_S)
        if self._worker.is_alive():
            logger.warning("engine thread did not stop within %.0f s", STOP_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return self._worker.is_alive() and (self.state in (EngineState.LOADING, EngineState.READY))

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
            waiting = self._worker.num_waiting + self._pending_adds
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
        lora_request: LoRARequest | None = None,
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
        self._worker.commands.put(
            Add(
                ids,
                prompts,
                params,
                arrival or time.monotonic(),
                future,
                beam_width,
                cache_salt,
                lora_request,
            )
        )
        try:
            await future
        except BaseException as exc:
            for rid in ids:
                self._routes.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError):
                # The add may still be applied: the abort queued behind it undoes it.
                self._worker.commands.put(Abort(ids, self.steps))
            raise
        finally:
            self._submits.discard(future)
            self._pending_adds -= len(ids)
        return RequestHandle(self.abort, ids, sink)

    async def load_adapter(self, request: LoRARequest) -> None:
        """Read and check ``request``'s adapter on a worker thread (not the step loop), then
        serve it; ``ValueError`` for an adapter it cannot serve, ``EngineUnavailable`` when the
        engine is not ready or LoRA is off."""
        info = self._ready_info()
        if info.lora_loader is None:
            raise ValueError("LoRA is off on this server (--enable-lora)")
        weights = await asyncio.to_thread(info.lora_loader, request)
        await self._adapter_command(AdapterOp.LOAD, weights=weights)

    async def unload_adapter(self, lora_id: int) -> None:
        """Forget an adapter once the requests in flight on it have finished (the caller stops
        sending it new ones first)."""
        self._ready_info()
        await self._adapter_command(AdapterOp.UNLOAD, lora_id=lora_id)

    def _ready_info(self) -> ModelInfo:
        error = self.not_ready()
        if error is not None:
            raise error
        assert self.info is not None
        return self.info

    async def _adapter_command(self, op: AdapterOp, **fields: object) -> None:
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        self._submits.add(future)
        try:
            self._worker.commands.put(AdapterCommand(op, future, **fields))  # type: ignore[arg-type]
            await future
        finally:
            self._submits.discard(future)

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
            self._worker.commands.put(Abort(live, self.steps))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted while the step ran
                continue
            if out.finished:
                del self._routes[out.request_id]
            sink, index = route
            sink.put(index, out)

    def _resolve(self, resolutions: list[Resolution]) -> None:
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
            self._worker.commands.put(Abort(list(self._routes), self.steps))
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
        if self._worker.idle or self.state is not EngineState.READY:
            return 0.0
        return max(0.0, time.monotonic() - self._worker.last_progress)

    def check_progress(self) -> None:
        """Declare the engine hung if a step has run longer than ``step_timeout``."""
        timeout = self.step_timeout
        if timeout is None or self._worker.hung or self.state is not EngineState.READY:
            return
        stalled = self.stalled_for()
        if stalled <= timeout:
            return
        self._worker.hung = True
        self._worker.state = EngineState.DEAD
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
