"""Microseconds per engine step with the model forward replaced by a stand-in.

Everything ``LLMEngine.step()`` does except the forward pass is timed: schedule, block moves,
building the step's inputs (token ids, positions, slot mapping, block tables), sampling,
detokenization, stop checks and building the outputs. The stand-in forward returns float32
logits of the right shape (``[rows to sample, vocab]``) from a preallocated buffer, so its own
cost is a slice. This is the per-step CPU work that bounds decode once kernels are fast (on a
GPU the forward is asynchronous and this work is what the GPU waits on).

For each ``--running`` count, that many greedy requests (``ignore_eos``, long ``max_tokens``) are
prefilled, then ``--steps`` decode steps are timed in thread CPU time (time spent descheduled by
other processes on a shared machine is not counted). ``--profile`` adds the split by phase;
``--metrics`` also times the server's metric accounting that follows every step on the engine
thread (``metrics_us_*``, not included in ``step_us_*``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from quire_engine.bench.workload import random_tokens
from quire_engine.core.detokenizer import Detokenizer
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine import llm_engine as engine_module
from quire_engine.engine.llm import LLM
from quire_engine.engine.metrics import EngineFacts, ServerMetrics
from quire_engine.engine.profile import timed
from quire_engine.engine.recorder import StatsRecorder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--running",
        default="1,64,256",
        help="comma-separated numbers of running sequences to measure",
    )
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per count")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="columns of the stand-in logits (default: the embedded model's vocabulary)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="split each step by phase")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="also time the server's per-step metric accounting (StatsRecorder.step and "
        "refresh, run by the engine thread after every step): metrics_us_*",
    )
    parser.add_argument(
        "--vllm-metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --metrics: the server also exports vLLM's names (as serve does by default)",
    )


@dataclass(slots=True)
class _Logits:
    logits: torch.Tensor


class StandInModel(torch.nn.Module):
    """Called like the transformers model the runner drives; returns ``[1, rows, vocab]`` logits
    for the rows in ``logits_to_keep``, sliced from a fixed random buffer (rows differ, so greedy
    picks differ between sequences)."""

    def __init__(self, vocab_size: int, max_rows: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.buffer = torch.randn((1, max_rows, vocab_size), generator=gen)  # [1, rows, vocab]

    def forward(self, *, logits_to_keep: torch.Tensor, **_: Any) -> _Logits:
        return _Logits(self.buffer[:, : logits_to_keep.shape[0]])


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = [int(c) for c in str(args.running).split(",")]
    if not counts or min(counts) < 1:
        raise ValueError(f"--running must list positive counts; got {args.running!r}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1; got {args.steps}")
    torch.set_num_threads(1)
    max_len = args.prompt_len + args.steps + 8
    blocks = max(counts) * -(-max_len // args.block_size)
    llm = LLM(
        block_size=args.block_size,
        num_blocks=blocks,
        max_model_len=max_len,
        max_num_seqs=max(counts),
        max_num_batched_tokens=max(2048, max(counts) * args.prompt_len),
        device="cpu",
        dtype="float32",
        threads=1,
    )
    engine = llm.engine
    vocab = args.vocab_size or engine.vocab_size
    engine.runner.model = StandInModel(vocab, max(counts), args.seed)  # type: ignore[assignment]
    result: dict[str, Any] = {
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "block_size": args.block_size,
        "vocab_size": vocab,
    }
    rng = random.Random(args.seed)
    for count in counts:
        result[str(count)] = _measure(engine, count, args, rng)
    return result


def _measure(
    engine: engine_module.LLMEngine, count: int, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
    ids = [f"step-{count}-{i}" for i in range(count)]
    for rid in ids:
        engine.add_request(rid, random_tokens(rng, args.prompt_len, 256), params)
    totals: dict[str, int] = {}
    try:
        engine.step()  # prefill every prompt (the budget holds them all)
        if engine.scheduler.num_running != count or engine.scheduler.num_waiting:
            raise ValueError(f"could not run {count} sequences at once")
        timings: list[float] = []
        accounting: list[float] = []
        recorder = _recorder(engine, ids, params, args.vllm_metrics) if args.metrics else None
        with _profiled(engine, totals, args.profile):
            for _ in range(args.steps):
                t0 = time.thread_time_ns()
                outputs = engine.step()
                t1 = time.thread_time_ns()
                timings.append((t1 - t0) / 1000)
                if recorder is not None:  # as AsyncEngine does after every step
                    now = time.monotonic()
                    recorder.step(outputs, now, now, engine.scheduler.stats())
                    accounting.append((time.thread_time_ns() - t1) / 1000)
    finally:
        for rid in ids:
            engine.abort_request(rid)
    timings.sort()
    out: dict[str, Any] = {
        "step_us_p50": round(statistics.median(timings), 1),
        "step_us_p99": round(timings[int(0.99 * (len(timings) - 1))], 1),
        "step_us_mean": round(statistics.fmean(timings), 1),
    }
    if accounting:
        accounting.sort()
        out["metrics_us_p50"] = round(statistics.median(accounting), 1)
        out["metrics_us_p99"] = round(accounting[int(0.99 * (len(accounting) - 1))], 1)
    if args.profile:
        total = sum(timings)
        phases = {name: ns / 1000 / args.steps for name, ns in totals.items()}
        phases["other"] = total / args.steps - sum(phases.values())
        out["split_us_per_step"] = {k: round(v, 1) for k, v in phases.items()}
    return out


def _recorder(
    engine: engine_module.LLMEngine, ids: list[str], params: SamplingParams, vllm: bool
) -> StatsRecorder:
    """A server's metric accounting for the running requests (its own registry)."""
    metrics = ServerMetrics("bench-step", vllm=vllm)
    recorder = StatsRecorder(metrics, engine.scheduler.stats(), EngineFacts.of(engine))
    now = time.monotonic()
    for rid in ids:
        recorder.added(rid, 0, params, now)
    return recorder


@contextmanager
def _profiled(engine: engine_module.LLMEngine, totals: dict[str, int], on: bool) -> Iterator[None]:
    """Time schedule, the runner (inputs + stand-in forward), sampling and detokenization."""
    if not on:
        yield
        return
    detok_cls = Detokenizer
    sched, runner = engine.scheduler, engine.runner
    with (
        _patched(sched, "schedule", timed(totals, "schedule", sched.schedule)),
        _patched(runner, "execute", timed(totals, "runner", runner.execute)),
        _patched(sched, "advance", timed(totals, "update", sched.advance)),
        _patched(engine_module, "sample", timed(totals, "sample", engine_module.sample)),
        _patched(
            engine_module, "greedy_tokens", timed(totals, "sample", engine_module.greedy_tokens)
        ),
        _patched(detok_cls, "add", timed(totals, "detokenize", detok_cls.add)),
    ):
        yield
