"""``quire-engine serve``: the OpenAI-compatible server under uvicorn.

Flags carry the names vLLM users expect. Every flag can also be set by an environment variable
``QUIRE_<FLAG>`` (``--max-num-seqs`` -> ``QUIRE_MAX_NUM_SEQS``), for containers; a flag on the
command line wins over the variable. With no flag at all it serves the embedded tiny model on
127.0.0.1:8000 (on CPU when there is no GPU).

The process serves while the model loads (``/health`` 200, ``/ready`` 503), so an orchestrator can
tell "loading" from "dead". If loading fails or the engine loop dies, the server shuts down and
the command exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from quire_engine.config import EngineConfig, PreemptionMode
from quire_engine.server import DEFAULT_MAX_BODY_BYTES, ServerSettings

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
    flag("--seed", "seed of unseeded sampling", type=int, default=0)
    flag(
        "--chat-template",
        "chat template (Jinja text, or a file holding it) replacing the tokenizer's own",
        default=None,
    )
    flag("--api-key", "require 'Authorization: Bearer <key>' on /v1", default=None)
    flag(
        "--max-waiting",
        "answer 503 when this many requests already wait (default: unbounded)",
        type=int,
        default=None,
    )
    flag(
        "--max-request-bytes",
        "answer 413 to larger request bodies",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
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
    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1; got {args.max_waiting}")
    if args.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1; got {args.max_request_bytes}")
    engine = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
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

    import uvicorn

    from quire_engine import model_loader
    from quire_engine.server import create_app

    settings = settings_from_args(args)
    # Fail before listening on what can be checked without loading anything.
    model_loader.resolve_dtype(args.dtype, model_loader.resolve_device(args.device))
    configure_logging(args.log_format, args.log_level)
    died: list[bool] = []
    server: uvicorn.Server | None = None

    def on_engine_death() -> None:
        died.append(True)
        if server is not None:
            server.should_exit = True  # uvicorn polls it; safe to set from the engine thread

    app = create_app(dataclasses.replace(settings, on_engine_death=on_engine_death))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    server.run()
    if died:
        logger.error("the engine died; exiting")
        return 1
    return 0
