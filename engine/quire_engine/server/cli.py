"""``quire-engine serve``: the OpenAI-compatible server under uvicorn.

Flags carry the names vLLM users expect. Every flag can also be set by an environment variable
``QUIRE_<FLAG>`` (``--max-num-seqs`` -> ``QUIRE_MAX_NUM_SEQS``), for containers; a flag on the
command line wins over the variable. With no flag at all it serves the embedded tiny model on
127.0.0.1:8000 (on CPU when there is no GPU).

The process serves while the model loads (``/health`` 200, ``/ready`` 503), so an orchestrator can
tell "loading" from "dead". With ``--wait-for-model-cache`` loading starts only once ``--model``
holds the model cache's completion marker (``quire_engine.hub_cache``), and fails after
``--model-cache-timeout`` seconds without it. If loading fails, the engine loop dies or a step
makes no progress for ``--step-timeout`` seconds, every pending request is answered, the server
shuts down and the command exits 1. SIGTERM (or Ctrl-C) drains (see ``drain``): ``/ready`` 503 at
once, new requests 503, requests in flight get ``--shutdown-timeout`` seconds, then exit 0; a
second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from quire_engine.core import knobs
from quire_engine.core.config import EngineConfig
from quire_engine.core.knobs import env_name as env_name  # re-exported: the flags' variables
from quire_engine.core.knobs import knob, section
from quire_engine.core.knobs import parse_bytes as parse_bytes  # re-exported: sizes of flags
from quire_engine.hub_cache import cache_dir, wait_for_cache
from quire_engine.server.app import ServerSettings
from quire_engine.server.drain import Drain

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """``quire-engine serve``'s whole command line, declared as knobs: the app's settings
    (``ServerSettings``, holding the engine's config tree) and what only the process uses."""

    settings: ServerSettings = section(ServerSettings)
    host: str = knob("127.0.0.1", "address to listen on")
    port: int = knob(8000, "port to listen on", min=0, max=65535)
    headless: bool = knob(
        False, "run only this node's tensor-parallel ranks, no HTTP server (nodes >= 1)"
    )
    wait_for_model_cache: bool = knob(
        False,
        "before loading, wait until --model holds the model cache's completion marker "
        "(.quire-complete.json, written last by the operator's download Job)",
    )
    model_cache_timeout: float = knob(
        3600.0, "seconds --wait-for-model-cache waits before the load fails", unit="seconds"
    )
    profile: bool = knob(
        False,
        "time every engine step by phase (matmuls, attention, rest of the forward, step "
        "Python) and export it on /metrics as quire_profile_step_cpu_seconds_total; for "
        "benchmarks (bench serve --profile): the hooks cost microseconds per module call",
    )
    log_format: str = knob("text", "log line format", choices=LOG_FORMATS)
    log_level: str = knob("info", "log level", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        knobs.check(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every knob of ``ServeOptions`` as a flag with its ``QUIRE_*`` variable (``knobs``)."""
    knobs.add_flags(parser, ServeOptions)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """``ValueError`` (naming the field) for values the engine would refuse. What the flags
    mean beyond their fields (0: never, the default names, where node 0 listens) is applied
    here, and the rules across fields are checked here."""
    if args.headless != (args.node_rank > 0):
        raise ValueError(
            "--headless goes with --node-rank >= 1: node 0 serves HTTP, the others only run "
            f"their ranks (got --node-rank {args.node_rank}"
            f"{' --headless' if args.headless else ''})"
        )
    if args.step_timeout < 0:
        raise ValueError(f"step_timeout must be >= 0 seconds (0: never); got {args.step_timeout}")
    if args.wait_for_model_cache and (args.model == "tiny" or args.model_cache_timeout <= 0):
        raise ValueError(
            "--wait-for-model-cache needs a checkpoint directory as --model and a "
            f"--model-cache-timeout above 0; got {args.model!r}, {args.model_cache_timeout:g}"
        )
    values = {name: getattr(args, name) for name in knobs.flags(ServeOptions)}
    values |= {
        "served_model_name": tuple(args.served_model_name or [args.model]),
        "api_key": args.api_key or None,
        "step_timeout": args.step_timeout or None,
        # Node 0 listens for the other nodes where it listens for HTTP.
        "master_addr": args.host if args.node_rank == 0 else args.master_addr,
    }
    return knobs.build(ServeOptions, values, what="serve arguments")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The app's settings of the parsed command line (see ``options_from_args``)."""
    return options_from_args(args).settings


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(log_format: str, level: str) -> None:
    """Root handler for Quire's and uvicorn's loggers alike (uvicorn runs with log_config=None,
    so its records propagate here and share the format)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from quire_engine.engine.llm_engine import LLMEngine, check_placement
    from quire_engine.engine.metrics import GcPauses
    from quire_engine.engine.startup import StartupPhase, StartupTimes
    from quire_engine.server.app import create_app

    settings = settings_from_args(args)
    configure_logging(args.log_format, args.log_level)
    # Counts from process start: quire_startup_seconds{phase="ready"} is the whole cold start.
    startup = StartupTimes.since_process_start()
    # Fail before listening on what can be checked without loading anything.
    check_placement(args.device, args.dtype)
    died: list[bool] = []
    server: _DrainingServer | None = None

    def on_engine_death() -> None:
        died.append(True)
        if server is not None:
            server.should_exit = True  # uvicorn polls it; safe to set from any thread

    settings = dataclasses.replace(
        settings,
        on_engine_death=on_engine_death,
        engine_factory=lambda config: LLMEngine(config, startup),
    )
    profile = None
    if args.profile:
        from quire_engine.engine.profile import StepProfile

        profile = StepProfile()
        factory = settings.engine_factory
        settings = dataclasses.replace(
            settings, engine_factory=lambda config: profile.install(factory(config))
        )
    build = settings.engine_factory

    def build_then_freeze(config: EngineConfig) -> LLMEngine:
        if args.wait_for_model_cache:
            with startup.phase(StartupPhase.MODEL_CACHE):
                wait_for_cache(cache_dir(Path(args.model)), args.model_cache_timeout)
        engine = build(config)
        logger.info("froze %d objects of the startup heap", freeze_startup_heap())
        return engine

    settings = dataclasses.replace(settings, engine_factory=build_then_freeze)
    app = create_app(settings)
    gc_pauses = GcPauses(app.state.metrics.registry, settings.served_model_names[0])
    if profile is not None:
        from quire_engine.engine.profile import ProfileCollector

        app.state.metrics.registry.register(
            ProfileCollector(profile, settings.served_model_names[0])
        )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=args.log_level,
        # After the drain every stream has ended; this only bounds writing their last bytes.
        timeout_graceful_shutdown=10,
    )
    server = _DrainingServer(config, app.state.drain)
    try:
        server.run()
    finally:
        gc_pauses.close()
    if died:
        logger.error("the engine died; exiting")
        return 1
    return 0


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now to the collector's permanent generation;
    returns how many that is.

    Called once the model is loaded: torch, transformers, the model and the tokenizer are then
    hundreds of thousands of objects that live as long as the process. Left in the oldest
    generation, every full collection traverses all of them (about 250 ms on a small CPU, every
    few thousand requests, with every stream stopped); frozen, full collections traverse only
    what serving created. vLLM freezes its engine's startup heap for the same reason. Only the
    serving process does this: a library caller's heap is not ours to freeze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains before shutting down (the listener
    stays open meanwhile, answering 503), and the signal is not re-raised at the end: a drained
    shutdown exits 0. A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the event loop's thread, between two bytecodes.
        if self._draining or self._loop is None or self.should_exit:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        task = asyncio.ensure_future(self._drain.run())
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Future[int]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("the drain failed", exc_info=task.exception())
        self.should_exit = True
