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
import os
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from quire_engine.core.config import DEFAULT_MASTER_PORT, EngineConfig, PreemptionMode
from quire_engine.hub_cache import wait_for_cache
from quire_engine.server.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WAITING,
    DEFAULT_STEP_TIMEOUT_S,
    ServerSettings,
)
from quire_engine.server.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain
from quire_engine.server.reasoning import ReasoningParserName
from quire_engine.server.tool_choice import ToolSettings
from quire_engine.server.tool_parsers import ToolParserName

ENV_PREFIX = "QUIRE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)

logger = logging.getLogger(__name__)


def parse_bytes(text: str) -> int:
    """``1073741824``, ``4G`` (10^9) or ``4GiB`` (2^30) -> bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 2147483648, 2G, 2GiB)")
    number, unit, binary = match.groups()
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _flag(parser: argparse.ArgumentParser, flag: str, help: str, **kwargs: Any) -> None:
    """``parser.add_argument`` whose default comes from ``QUIRE_<FLAG>`` when that is set."""
    name = env_name(flag)
    raw = os.environ.get(name)
    kwargs["help"] = f"{help} [env {name}]"
    if raw is not None:
        kwargs["default"] = _from_env(parser, name, raw, kwargs)
    parser.add_argument(flag, **kwargs)


def _from_env(parser: argparse.ArgumentParser, name: str, raw: str, kwargs: dict[str, Any]) -> Any:
    try:
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            if raw.strip().lower() not in _TRUE | _FALSE:
                raise ValueError("expected true or false")
            return raw.strip().lower() in _TRUE
        if kwargs.get("nargs") == "+":
            return [part for part in re.split(r"[,\s]+", raw) if part]
        convert: Callable[[str], Any] = kwargs.get("type", str)
        value = convert(raw)
    except ValueError as exc:
        parser.error(f"{name}={raw!r}: {exc}")
    if "choices" in kwargs and value not in kwargs["choices"]:
        parser.error(f"{name}={raw!r}: choose from {', '.join(kwargs['choices'])}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def flag(name: str, help: str, **kwargs: Any) -> None:
        _flag(parser, name, help, **kwargs)

    flag("--model", "checkpoint directory, or 'tiny' for the embedded model", default="tiny")
    flag(
        "--served-model-name",
        "name(s) clients use in 'model'; the first one names responses and metrics "
        "(default: --model)",
        nargs="+",
        default=None,
    )
    flag("--host", "address to listen on", default="127.0.0.1")
    flag("--port", "port to listen on", type=int, default=8000)
    flag("--device", "auto, cpu, cuda or cuda:N", default="auto")
    flag(
        "--dtype",
        "weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU)",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
    )
    flag("--block-size", "tokens per KV block", type=int, default=16)
    flag(
        "--gpu-memory-utilization",
        "share of GPU memory for weights, activations and the KV pool",
        type=float,
        default=0.9,
    )
    flag(
        "--kv-cache-memory",
        "KV pool size (bytes, or 4G / 4GiB); overrides --gpu-memory-utilization",
        type=parse_bytes,
        default=None,
    )
    flag("--num-blocks", "KV pool size in blocks (overrides both above)", type=int, default=None)
    flag("--max-num-seqs", "sequences running at once", type=int, default=256)
    flag("--max-num-batched-tokens", "tokens per step", type=int, default=None)
    flag("--max-model-len", "context length (default: the model's)", type=int, default=None)
    flag(
        "--enable-prefix-caching",
        "share KV blocks of identical prompt prefixes",
        action=argparse.BooleanOptionalAction,
        default=True,
    )
    flag(
        "--preemption-mode",
        "what preemption does to a victim's KV blocks",
        choices=[m.value for m in PreemptionMode],
        default="recompute",
    )
    flag("--swap-space", "CPU swap pool for --preemption-mode swap (GiB)", type=float, default=4.0)
    flag(
        "--tensor-parallel-size",
        "shard the model over this many devices, one worker process each (cuda:N..N+size-1)",
        type=int,
        default=1,
    )
    flag(
        "--nnodes",
        "nodes (pods) the --tensor-parallel-size ranks are spread over, equally",
        type=int,
        default=1,
    )
    flag(
        "--node-rank",
        "this node's index; node 0 serves HTTP and listens for the others on --host",
        type=int,
        default=0,
    )
    flag("--master-addr", "node 0's address, where nodes >= 1 connect", default="127.0.0.1")
    flag(
        "--master-port",
        "node 0's rendezvous port (under --nnodes > 1)",
        type=int,
        default=DEFAULT_MASTER_PORT,
    )
    flag(
        "--headless",
        "run only this node's tensor-parallel ranks, no HTTP server (nodes >= 1)",
        action=argparse.BooleanOptionalAction,
        default=False,
    )
    flag(
        "--wait-for-model-cache",
        "before loading, wait until --model holds the model cache's completion marker "
        "(.quire-complete.json, written last by the operator's download Job)",
        action=argparse.BooleanOptionalAction,
        default=False,
    )
    flag(
        "--model-cache-timeout",
        "seconds --wait-for-model-cache waits before the load fails",
        type=float,
        default=3600.0,
    )
    flag("--seed", "seed of unseeded sampling", type=int, default=0)
    flag(
        "--chat-template",
        "chat template (Jinja text, or a file holding it) replacing the tokenizer's own",
        default=None,
    )
    flag("--api-key", "require 'Authorization: Bearer <key>' on /v1", default=None)
    flag(
        "--max-waiting",
        "answer 503 when this many requests already wait",
        type=int,
        default=DEFAULT_MAX_WAITING,
    )
    flag(
        "--shutdown-timeout",
        "on SIGTERM, seconds requests in flight get to finish before they are ended",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
    )
    flag(
        "--step-timeout",
        "seconds without engine progress, while work is pending, after which /health turns 503 "
        "and the server exits 1 (0: never)",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
    )
    flag(
        "--max-request-bytes",
        "answer 413 to larger request bodies",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
    )
    flag(
        "--profile",
        "time every engine step by phase (matmuls, attention, rest of the forward, step "
        "Python) and export it on /metrics as quire_profile_step_cpu_seconds_total; for "
        "benchmarks (bench serve --profile): the hooks cost microseconds per module call",
        action=argparse.BooleanOptionalAction,
        default=False,
    )
    flag(
        "--vllm-metrics",
        "also export vLLM's metric names (vllm:*) on /metrics, for routers, dashboards and "
        "benchmarks written for vLLM; --no-vllm-metrics exports the quire_* series only",
        action=argparse.BooleanOptionalAction,
        default=True,
    )
    flag(
        "--enable-auto-tool-choice",
        "allow tool_choice 'auto' (the default when a request has tools): the model's calls "
        "are read out of its text by --tool-call-parser",
        action=argparse.BooleanOptionalAction,
        default=False,
    )
    flag(
        "--tool-call-parser",
        "the format of the model's tool calls, for tool_choice 'auto'",
        choices=[p.value for p in ToolParserName],
        default=None,
    )
    flag(
        "--reasoning-parser",
        "split the model's thinking (<think>...</think>) into reasoning_content",
        choices=[p.value for p in ReasoningParserName],
        default=None,
    )
    flag("--log-format", "log line format", choices=["text", "json"], default="text")
    flag(
        "--log-level",
        "log level",
        choices=["debug", "info", "warning", "error"],
        default="info",
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """``ValueError`` (naming the field) for values the engine would refuse."""
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
    engine = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        # Node 0 listens for the other nodes where it listens for HTTP.
        master_addr=args.host if args.node_rank == 0 else args.master_addr,
        master_port=args.master_port,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        chat_template=args.chat_template,
    )
    names = tuple(args.served_model_name or [args.model])
    return ServerSettings(
        engine=engine,
        served_model_names=names,
        api_key=args.api_key or None,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_request_bytes,
        step_timeout=args.step_timeout or None,
        shutdown_timeout=args.shutdown_timeout,
        vllm_metrics=args.vllm_metrics,
        tools=ToolSettings(
            args.enable_auto_tool_choice,
            ToolParserName(args.tool_call_parser) if args.tool_call_parser else None,
        ),
        reasoning_parser=ReasoningParserName(args.reasoning_parser)
        if args.reasoning_parser
        else None,
    )


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
                wait_for_cache(Path(args.model), args.model_cache_timeout)
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
