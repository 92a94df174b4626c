"""How long the engine took to start, by phase: logged, and exported on ``/metrics`` as
``quire_startup_seconds{phase}``.

``StartupTimes`` is owned by the ``LLMEngine`` it times (``LLMEngine.startup``), written by the
thread that builds and warms it up (the server's engine thread) and read once ready. The phases
run one after the other; whatever runs between them (Python imports before ``serve`` starts its
engine, building the app, starting the thread) belongs to no phase, so the phases add up to at
most ``ready``:

* ``imports``: process start to the creation of the recorder (only ``serve`` records it: its
  recorder counts from process start, ``StartupTimes.since_process_start``). Mostly importing
  torch and transformers.
* ``model_cache``: waiting for a shared model cache to be complete. Recorded only when something
  waits, by wrapping the wait in ``phase(StartupPhase.MODEL_CACHE)``; absent otherwise.
* ``weights``: the config, tokenizer and weights read and placed on the device (``loader.load``).
* ``kv_profile``: sizing the KV pool (``cache_plan``): on CUDA a profiling forward pass.
* ``kv_allocate``: allocating the KV pool and building the runner (native CPU kernels are
  loaded, or compiled into their cache the first time).
* ``warmup``: one short request through the whole engine (``async_engine``).
* ``ready``: the recorder's origin (process start for ``serve``) to ready to serve.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

logger = logging.getLogger(__name__)


class StartupPhase(enum.StrEnum):
    IMPORTS = "imports"
    MODEL_CACHE = "model_cache"
    WEIGHTS = "weights"
    KV_PROFILE = "kv_profile"
    KV_ALLOCATE = "kv_allocate"
    WARMUP = "warmup"
    READY = "ready"


class StartupTimes:
    """Seconds per phase, measured on ``clock`` from ``origin`` (a reading of that clock).

    Each phase is recorded once (``ValueError`` on a second one, or on ``ready`` inside
    ``phase``: a phase that runs twice or overlaps another would not add up)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, origin: float | None = None
    ) -> None:
        self._clock = clock
        self._origin = clock() if origin is None else origin
        self._seconds: dict[StartupPhase, float] = {}
        self._open: StartupPhase | None = None

    @classmethod
    def since_process_start(cls) -> StartupTimes:
        """A recorder whose origin is this process's start (where /proc says when that was;
        now elsewhere), with ``imports`` recorded: the time up to now."""
        age = process_age()
        now = time.monotonic()
        times = cls(time.monotonic, now - (age or 0.0))
        if age is not None:
            times._record(StartupPhase.IMPORTS, age)
        return times

    @contextlib.contextmanager
    def phase(self, phase: StartupPhase) -> Iterator[None]:
        """Time the body as ``phase`` (recorded, and logged, only when the body returns)."""
        if phase is StartupPhase.READY:
            raise ValueError("ready is not a phase to time; call ready()")
        if self._open is not None:
            raise ValueError(f"phase {phase} started inside phase {self._open}")
        if phase in self._seconds:
            raise ValueError(f"phase {phase} was already recorded")
        self._open = phase
        started = self._clock()
        try:
            yield
        finally:
            self._open = None
        self._record(phase, self._clock() - started)

    def ready(self) -> float:
        """Record ``ready`` (origin to now), log the summary line; returns the seconds."""
        if self._open is not None:
            raise ValueError(f"ready inside phase {self._open}")
        total = self._clock() - self._origin
        phases = ", ".join(f"{p} {s:.3f} s" for p, s in self._seconds.items())
        self._record(StartupPhase.READY, total)
        logger.info("startup: ready in %.3f s (%s)", total, phases or "no phase recorded")
        return self._seconds[StartupPhase.READY]

    @property
    def seconds(self) -> Mapping[StartupPhase, float]:
        """The phases recorded so far, in the order they ran (read-only view)."""
        return MappingProxyType(self._seconds)

    def _record(self, phase: StartupPhase, seconds: float) -> None:
        if phase in self._seconds:
            raise ValueError(f"phase {phase} was already recorded")
        self._seconds[phase] = max(seconds, 0.0)
        if phase is not StartupPhase.READY:
            logger.info("startup phase %s: %.3f s", phase, seconds)


def process_age() -> float | None:
    """Seconds since this process started, from ``/proc`` (Linux: clock ticks, so within about
    20 ms); None where there is no ``/proc``."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after its last ')'.
    # starttime is field 22, the 20th after the name.
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
