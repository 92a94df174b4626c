"""Microseconds per ``Scheduler.schedule()`` with many running decode sequences.

The control plane runs on the critical path of every step; at 256 decode sequences it must stay
far below a GPU decode step (a few milliseconds). ``update`` runs between steps but is not timed.
Steps are timed in thread CPU time, so time spent descheduled by other processes on a shared
machine is not counted (cache and frequency effects still are).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from quire_engine.bench.workload import random_tokens
from quire_engine.core.config import CacheConfig, SchedulerConfig
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import FinishReason, Sequence


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    max_len = args.prompt_len + args.steps + 64
    blocks_per_seq = -(-max_len // args.block_size)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.running,
            max_num_batched_tokens=max(8192, args.running * args.prompt_len),
            max_model_len=max_len,
        ),
        CacheConfig(num_blocks=args.running * blocks_per_seq, block_size=args.block_size),
    )
    for i in range(args.running):
        sched.add(Sequence(f"s{i}", random_tokens(rng, args.prompt_len), max_tokens=max_len))
    # Prefill everything first so the timed steps are pure decode.
    out = sched.schedule()
    sched.update(out, {s.seq_id: 1 for s in out.seqs})
    if len(sched.running) != args.running:
        raise ValueError("not every sequence was admitted; raise the pool size")
    timings = []
    clock = time.thread_time_ns
    for _ in range(args.steps):
        t0 = clock()
        out = sched.schedule()
        timings.append((clock() - t0) / 1000)
        sched.update(out, {s.seq_id: rng.randrange(32000) for s in out.seqs})
    for seq in list(sched.seqs.values()):
        sched.finish(seq, FinishReason.ABORT)
    timings.sort()
    return {
        "running": args.running,
        "steps": args.steps,
        "block_size": args.block_size,
        "step_us_p50": round(statistics.median(timings), 1),
        "step_us_p99": round(timings[int(0.99 * (len(timings) - 1))], 1),
        "step_us_mean": round(statistics.fmean(timings), 1),
    }
