"""Quire beside busy neighbours: offline tok/s at one and ``--threads`` threads, with and
without processes that keep cores busy, under the OpenMP wait policy Quire sets (``after``) and
under libgomp's default spinning waits (``before``), all in one run.

Each run is a fresh process (libgomp reads its wait policy once, when torch loads it) running
``bench throughput``'s workload for Quire alone, at ``--threads`` torch threads
(``LLM(threads=...)``), with the preset's model (random weights, seeded) and a smaller request
mix by default so that the slow corner (spinning waits beside neighbours) finishes in minutes.
``before`` sets ``GOMP_SPINCOUNT=300000``, libgomp's default spin count, which Quire leaves
alone as a user's choice (``core.threads``); ``after`` clears ``OMP_WAIT_POLICY`` and
``GOMP_SPINCOUNT`` so that Quire's passive waits apply. A neighbour is a ``while True: pass``
Python process, one per core ``--neighbours``; the runs alternate policies within each
(neighbours, threads) cell, so that a shared machine's drift touches both alike.

Reported: every run's tok/s and tok per CPU second, per neighbour count the ratios
``threads_over_one`` (N threads over one, per policy: below 1 is the cliff) and
``after_over_before`` (per thread count), and ``outputs_identical``: every run generated the
same greedy tokens (the wait policy and the thread count change no result).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

POLICIES = ("before", "after")
LIBGOMP_DEFAULT_SPINS = "300000"  # libgomp's GOMP_SPINCOUNT when no policy is set
_CHILD = "import sys; from quire_engine.bench.contention import child; child(sys.argv[1])"
_NEIGHBOUR = "while True: pass"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="threads of the multi-thread runs")
    parser.add_argument(
        "--neighbours",
        type=int,
        default=None,
        help="busy processes beside the engine in the loaded runs (default: --threads, one per "
        "core the engine's threads use)",
    )
    parser.add_argument("--preset", default="32m", help="bench throughput's preset (the model)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--mean-prompt", type=float, default=64)
    parser.add_argument("--mean-output", type=float, default=64)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None, help="default: the preset's")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1; got {args.threads}")
    neighbours = args.threads if args.neighbours is None else args.neighbours
    if neighbours < 0:
        raise ValueError(f"--neighbours must be >= 0; got {neighbours}")
    workload = [
        "--preset", args.preset, "--systems", "quire",
        "--num-requests", str(args.num_requests), "--mean-prompt", str(args.mean_prompt),
        "--mean-output", str(args.mean_output), "--hidden-size", str(args.hidden_size),
    ] + (["--layers", str(args.layers)] if args.layers is not None else [])  # fmt: skip
    runs: list[dict[str, Any]] = []
    for count in sorted({0, neighbours}):
        for threads in sorted({1, args.threads}):
            for policy in POLICIES:
                with _Neighbours(count):
                    measured = _spawn(policy, [*workload, "--threads", str(threads)])
                runs.append({"neighbours": count, "threads": threads, "policy": policy} | measured)
    return {
        "threads": args.threads,
        "neighbours": neighbours,
        "cpus": len(os.sched_getaffinity(0)),
        "runs": [{k: v for k, v in r.items() if k != "digest"} for r in runs],
        "ratios": _ratios(runs, args.threads),
        "outputs_identical": len({r["digest"] for r in runs}) == 1,
    }


def _ratios(runs: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    rate = {(r["neighbours"], r["threads"], r["policy"]): r["tok_s"] for r in runs}
    out: dict[str, Any] = {}
    for count in sorted({r["neighbours"] for r in runs}):
        out[f"neighbours_{count}"] = {
            "threads_over_one": {
                p: round(rate[count, threads, p] / rate[count, 1, p], 2) for p in POLICIES
            },
            "after_over_before": {
                str(t): round(rate[count, t, "after"] / rate[count, t, "before"], 2)
                for t in sorted({1, threads})
            },
        }
    return out


class _Neighbours:
    """``count`` busy-looping processes for the length of a ``with`` block; this class owns
    them and stops them on the way out."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> _Neighbours:
        for _ in range(self._count):
            self._procs.append(subprocess.Popen([sys.executable, "-c", _NEIGHBOUR]))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.wait()


def _spawn(policy: str, argv: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.pop("OMP_NUM_THREADS", None)  # the runs' thread count is --threads
    if policy == "before":
        env["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPINS
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise ValueError(f"the {policy} run failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def child(argv_json: str) -> None:
    """One timed run (in a fresh process): prints tok/s, tok per CPU second, the thread count
    the engine ran and a digest of the generated tokens as one JSON line."""
    import tempfile

    import torch

    from quire_engine.bench import throughput
    from quire_engine.bench.workload import warm_up_prompts
    from quire_engine.core.sampling_params import SamplingParams

    args = throughput.parse(json.loads(argv_json))
    lengths, prompts = throughput.workload(args)
    budget = args.budget_seqs * args.max_model_len
    model = throughput.bench_model(args)
    params = throughput.request_params(lengths)
    with (
        tempfile.TemporaryDirectory() as tmp,
        throughput.quire_llm(model, Path(tmp), budget, args) as llm,
    ):
        warm = warm_up_prompts(prompts, 4)
        llm.generate(warm, [SamplingParams(temperature=0.0, max_tokens=4)] * len(warm))
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(t) for t in tokens)
    print(
        json.dumps(
            {
                "tok_s": round(produced / wall, 1),
                "tok_per_cpu_s": round(produced / cpu, 1),
                "engine_threads": torch.get_num_threads(),
                "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
            }
        )
    )
