"""``quire-engine`` command line: ``serve`` (the OpenAI-compatible server) and ``bench <name>``.

Each benchmark lives in ``quire_engine.bench.<name>`` and exposes ``add_arguments(parser)`` and
``run(args) -> dict``; the CLI prints the dict as one JSON object. ``serve`` lives in
``quire_engine.server.cli`` with ``add_arguments(parser)`` and ``run(args) -> exit code``.
Modules are imported lazily so ``bench allocator`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

BENCHES = {
    "allocator": "paged KV pool vs a contiguous allocator at the same KV budget",
    "scheduler": "microseconds per schedule() step with many running sequences",
    "step": "microseconds per engine step with a stand-in forward (schedule, inputs, sampling)",
    "kernel": "paged decode attention bandwidth vs torch SDPA (CUDA; --device cpu: native)",
    "linear": "small-batch CPU matmuls: the native few-row linear vs torch's BLAS",
    "throughput": "offline throughput vs transformers static and continuous batching",
    "serve": "load generator against a running server: Poisson arrivals, TTFT/TPOT/ITL",
    "route": "a fleet through a routing gateway vs the plain Service: prefix hits, TTFT, overhead",
    "structured": "structured outputs: constrained vs unconstrained throughput, compile time, TTFT",
    "load": "loading a safetensors checkpoint, by loader: seconds and peak resident memory",
    "startup": "cold start of serve by phase (tiny and 32m): weights, KV pool, warm-up, ready",
    "kv_cache": "KV cache formats side by side: capacity, KV-limited throughput, accuracy",
    "contention": "1 vs N threads beside busy neighbour processes, OpenMP's spinning waits vs "
    "Quire's passive ones (tok/s ratios)",
    "kv_offload": "the host tier under the prefix cache, on vs off: multi-turn, shared system "
    "prompts, no hits (hit rate, TTFT, prefill computed, throughput)",
    "lora": "LoRA adapters: a batch mixing 1, 4, 16 adapters vs the base model; adapter load time",
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Only the selected benchmark's module is imported (``bench kernel`` needs torch, the
    allocator benchmark does not)."""
    selected = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    parser = argparse.ArgumentParser(prog="quire-engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve_help = "serve the OpenAI-compatible HTTP API (default: the embedded tiny model)"
    # No prefix matching: an operator-managed flag must never be overridden by an abbreviation
    # (e.g. `--block 32` in an InferenceService's extraArgs).
    serve = commands.add_parser(
        "serve", help=serve_help, description=serve_help, allow_abbrev=False
    )
    if argv and argv[0] == "serve":
        importlib.import_module("quire_engine.server.cli").add_arguments(serve)
    bench = commands.add_parser("bench", help="run a benchmark and print JSON")
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHES.items():
        sub = benches.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="print one compact JSON line")
        if name == selected:
            importlib.import_module(f"quire_engine.bench.{name}").add_arguments(sub)
    return parser


def _headless(serve: ModuleType, args: argparse.Namespace) -> int:
    """``serve --headless``: this node's tensor-parallel ranks only (``parallel/node``)."""
    config = serve.settings_from_args(args).engine
    serve.configure_logging(args.log_format, args.log_level)
    if args.wait_for_model_cache:  # its ranks read their shards from the same cache
        from quire_engine.hub_cache import wait_for_cache

        wait_for_cache(Path(args.model), args.model_cache_timeout)
    return int(importlib.import_module("quire_engine.parallel.node").run(config))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if args.command == "serve":
        serve = importlib.import_module("quire_engine.server.cli")
        try:
            if args.headless:
                return _headless(serve, args)
            return int(serve.run(args))
        except ValueError as exc:
            print(f"quire-engine: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "bench":
        module = importlib.import_module(f"quire_engine.bench.{args.bench}")
        try:
            result = module.run(args)
        except ValueError as exc:
            print(f"quire-engine: error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
