"""Cold start of ``quire-engine serve``, by phase: the embedded ``tiny`` model and the ``32m``
benchmark Llama (``bench throughput --preset 32m``, saved as a safetensors checkpoint).

Each run starts a fresh server process on loopback (one torch thread, as ``bench serve``
launches it, and ``serve``'s defaults otherwise: the CPU's default KV pool), polls ``/ready``
every 20 ms, sends one streamed completion as soon as it answers, reads
``quire_startup_seconds{phase}`` from its ``/metrics`` and stops it. Per preset it reports the
median and the minimum over ``--repeats`` runs of every phase (as the server measured it) and of
what a client sees from spawning the process: ``/ready`` answering, and the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx2

from quire_engine.bench import peers
from quire_engine.bench.client import scrape, stream_completion
from quire_engine.bench.load import PRESETS as CHECKPOINTS
from quire_engine.bench.workload import RequestLengths

PRESETS = ("tiny", "32m")
POLL_S = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--presets", default=",".join(PRESETS), help=f"comma-separated subset of {PRESETS}"
    )
    parser.add_argument("--repeats", type=int, default=5, help="server starts per preset")
    parser.add_argument(
        "--serve-args",
        default="",
        help="extra flags for every server, as one string (e.g. '--num-blocks 512')",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    presets = [p for p in args.presets.split(",") if p]
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown or not presets:
        raise ValueError(f"--presets: choose from {', '.join(PRESETS)}; got {args.presets!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {args.repeats}")
    extra = args.serve_args.split()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="quire-bench-startup-") as tmp:
        work = Path(tmp)
        for preset in presets:
            model = "tiny"
            if preset == "32m":
                model = str(peers.build_model_dir(work / "llama-32m", **CHECKPOINTS["32m"]))
            logs = [work / f"{preset}-{i}.log" for i in range(args.repeats)]
            runs = [start_once(model, extra, log) for log in logs]
            results[preset] = summarize(runs)
    return {"repeats": args.repeats, "serve_args": args.serve_args, "presets": results}


def start_once(model: str, extra: list[str], log_path: Path) -> dict[str, float]:
    """One cold start: the server's phases, and the client's seconds from spawning it to
    ``/ready`` (``client_ready``) and to the first streamed token (``client_first_token``)."""
    port = peers.free_port()
    argv = [
        sys.executable, "-m", "quire_engine.cli", "serve",
        "--model", model, "--served-model-name", "bench", "--port", str(port),
        "--device", "cpu", "--log-level", "warning", *extra,
    ]  # fmt: skip
    spawned = time.perf_counter()
    with peers.started(argv, port, "/ready", log_path, name="quire", poll_s=POLL_S) as server:
        ready = time.perf_counter() - spawned
        first_token, phases = asyncio.run(_first_token_and_phases(server.url))
    return {**phases, "client_ready": ready, "client_first_token": ready + first_token}


async def _first_token_and_phases(url: str) -> tuple[float, dict[str, float]]:
    async with httpx2.AsyncClient(base_url=url, timeout=60.0) as client:
        result = await stream_completion(client, "bench", "Hello", RequestLengths(1, 1), None)
        if result.error is not None or result.ttft is None:
            raise ValueError(f"the first request failed: {result.error}")
        families = await scrape(client)
    phases = {
        sample.labels["phase"]: sample.value
        for family in families
        if family.name == "quire_startup_seconds"
        for sample in family.samples
    }
    if "ready" not in phases:
        raise ValueError("the server exported no quire_startup_seconds{phase='ready'}")
    return result.ttft, phases


def summarize(runs: Iterable[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per key: median and minimum seconds over the runs (keys every run has, in the first
    run's order)."""
    runs = list(runs)
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {
        key: {
            "median_s": round(statistics.median(r[key] for r in runs), 3),
            "min_s": round(min(r[key] for r in runs), 3),
        }
        for key in keys
    }
