"""Paged KV pool vs a contiguous allocator at the same KV budget (the PagedAttention paper's memory
result), replayed through the real ``Scheduler`` and ``KVCacheManager``.

Both systems get the same budget in tokens. The contiguous allocator reserves ``max_model_len``
slots per request, as pre-paging servers did; the paged pool takes a block at a time. Each step
every running sequence computes its next token (a model-free replay: memory is what is measured).
utilization = slots holding written tokens / slots allocated, averaged over steps.

``--shared-prefix`` instead measures sharing: n parallel samples (fork + copy-on-write) of requests
that share a long system prompt (prefix cache), against the same requests with no sharing.

``--sliding-window W`` measures the blocks one sequence holds as its context grows, for a model
whose every layer has a window of ``W`` (Mistral-style: blocks wholly before the window are
released) against full attention (every block is kept): a 128-token prompt generating up to each
of ``--contexts`` tokens, prefilled in chunks of ``--chunk`` tokens.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from quire_engine.bench.workload import RequestLengths, random_tokens, sharegpt_like
from quire_engine.core.config import CacheConfig, SchedulerConfig
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import Sequence

SWEEP = (8, 16, 32, 64, 128)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sweep", action="store_true", help=f"run block sizes {SWEEP}")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--budget-seqs",
        type=int,
        default=16,
        help="KV budget in max-length sequences (budget tokens = this * max_model_len)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-prefix", action="store_true")
    parser.add_argument("--system-prompt-len", type=int, default=1000)
    parser.add_argument("--n", type=int, default=4, help="parallel samples per request")
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="blocks held vs context with window W"
    )
    parser.add_argument(
        "--contexts",
        default="1024,4096,16384,32768",
        help="context lengths for --sliding-window, comma-separated",
    )
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (token budget)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.sliding_window is not None:
        try:
            contexts = [int(c) for c in args.contexts.split(",")]
        except ValueError:
            raise ValueError(f"--contexts must be integers, got {args.contexts!r}") from None
        return window_blocks(
            block_size=args.block_size,
            window=args.sliding_window,
            contexts=contexts,
            chunk=args.chunk,
        )
    if args.shared_prefix:
        return shared_prefix(
            num_requests=min(args.num_requests, 100),
            block_size=args.block_size,
            system_prompt_len=args.system_prompt_len,
            n=args.n,
            seed=args.seed,
        )
    lengths = sharegpt_like(args.num_requests, max_model_len=args.max_model_len, seed=args.seed)
    budget = args.budget_seqs * args.max_model_len
    sizes = SWEEP if args.sweep else (args.block_size,)
    results = [_compare(lengths, budget, bs, args.max_model_len, args.seed) for bs in sizes]
    if args.sweep:
        return {"kv_budget_tokens": budget, "sweep": results}
    return results[0]


def _compare(
    lengths: list[RequestLengths], budget: int, block_size: int, max_model_len: int, seed: int
) -> dict[str, Any]:
    paged = replay_paged(lengths, budget, block_size, max_model_len, seed)
    contiguous = replay_contiguous(lengths, budget, max_model_len)
    return {
        "block_size": block_size,
        "num_requests": len(lengths),
        "kv_budget_tokens": budget,
        "paged": paged,
        "contiguous": contiguous,
        "concurrency_ratio": round(paged["max_concurrent"] / contiguous["max_concurrent"], 3),
        "mean_concurrency_ratio": round(
            paged["mean_concurrent"] / contiguous["mean_concurrent"], 3
        ),
        "saturated_concurrency_ratio": round(
            paged["saturated_concurrent"] / contiguous["max_concurrent"], 3
        ),
    }


def replay_paged(
    lengths: list[RequestLengths], budget: int, block_size: int, max_model_len: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=4096, max_num_batched_tokens=8192, max_model_len=max_model_len
        ),
        CacheConfig(
            num_blocks=budget // block_size, block_size=block_size, enable_prefix_caching=False
        ),
    )
    for i, req in enumerate(lengths):
        sched.add(Sequence(f"r{i}", random_tokens(rng, req.prompt), max_tokens=req.output))
    util_sum = conc_sum = busy_sum = 0.0
    steps = max_conc = busy_steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        if sched.waiting:  # saturated: memory, not the workload, limits concurrency
            busy_sum += len(sched.running)
            busy_steps += 1
        sched.update(
            out, {s.seq_id: 0 for s, sample in zip(out.seqs, out.samples, strict=True) if sample}
        )
        used_slots = sched.kv.stats().used * block_size
        if used_slots:
            written = sum(s.num_computed_tokens for s in sched.running)
            util_sum += written / used_slots
            conc_sum += len(sched.running)
            max_conc = max(max_conc, len(sched.running))
            steps += 1
    return {
        "utilization": round(util_sum / steps, 4),
        "max_concurrent": max_conc,
        "mean_concurrent": round(conc_sum / steps, 2),
        "saturated_concurrent": round(busy_sum / max(busy_steps, 1), 2),
        "steps": steps,
        "preemptions": sum(sched.num_preemptions.values()),
    }


def replay_contiguous(
    lengths: list[RequestLengths], budget: int, max_model_len: int
) -> dict[str, Any]:
    """Each admitted request reserves ``max_model_len`` slots until it finishes. Step 1 of a
    request computes its prompt and first token, each later step one token (as in the paged run)."""
    slots = budget // max_model_len
    if slots < 1:
        raise ValueError(f"budget of {budget} tokens holds no sequence of {max_model_len}")
    queue = list(reversed(lengths))
    running: list[list[int]] = []  # [tokens written, tokens to generate left]
    util_sum = conc_sum = 0.0
    steps = max_conc = 0
    while queue or running:
        while queue and len(running) < slots:
            req = queue.pop()
            running.append([0, req.output, req.prompt])
        for r in running:
            # The first step writes the prompt; each step emits one token; the last emitted
            # token is never written (nothing reads it), as in the paged replay.
            r[0] = r[2] if r[0] == 0 else r[0] + 1
            r[1] -= 1
        written = sum(r[0] for r in running)
        util_sum += written / (len(running) * max_model_len)
        conc_sum += len(running)
        max_conc = max(max_conc, len(running))
        steps += 1
        running = [r for r in running if r[1] > 0]
    return {
        "utilization": round(util_sum / steps, 4),
        "max_concurrent": max_conc,
        "mean_concurrent": round(conc_sum / steps, 2),
        "steps": steps,
    }


def shared_prefix(
    *, num_requests: int, block_size: int, system_prompt_len: int, n: int, seed: int
) -> dict[str, Any]:
    """Peak device blocks for ``num_requests`` requests x ``n`` samples sharing a system prompt,
    with sharing (prefix cache across requests + fork/CoW across samples) and without."""
    rng = random.Random(seed)
    system = random_tokens(rng, system_prompt_len)
    lengths = sharegpt_like(num_requests, mean_prompt=60, seed=seed)
    prompts = [system + random_tokens(rng, req.prompt) for req in lengths]
    shared = _replay_samples(prompts, lengths, block_size, n, share=True)
    unshared = _replay_samples(prompts, lengths, block_size, n, share=False)
    return {
        "block_size": block_size,
        "num_requests": num_requests,
        "n": n,
        "system_prompt_len": system_prompt_len,
        "shared": shared,
        "unshared": unshared,
        "peak_blocks_saved_fraction": round(1 - shared["peak_blocks"] / unshared["peak_blocks"], 4),
        "mean_blocks_saved_fraction": round(1 - shared["mean_blocks"] / unshared["mean_blocks"], 4),
    }


def _replay_samples(
    prompts: list[list[int]], lengths: list[RequestLengths], block_size: int, n: int, share: bool
) -> dict[str, Any]:
    # A pool large enough that nothing is preempted: the peak is the workload's true demand.
    total = sum(len(p) + r.output for p, r in zip(prompts, lengths, strict=True)) * n
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=100_000, max_num_batched_tokens=4096, max_model_len=4096),
        CacheConfig(
            num_blocks=total // block_size + 16 * len(prompts) * n,
            block_size=block_size,
            enable_prefix_caching=share,
        ),
    )
    rng = random.Random(1)
    for i, (prompt, req) in enumerate(zip(prompts, lengths, strict=True)):
        if share:
            sched.add(Sequence(f"r{i}", prompt, max_tokens=req.output))
        else:
            for j in range(n):
                sched.add(Sequence(f"r{i}.{j}", prompt, max_tokens=req.output))
    peak = steps = 0
    blocks_sum = 0.0
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {}
        forks = []
        for seq, sample in zip(out.seqs, out.samples, strict=True):
            if sample:
                sampled[seq.seq_id] = rng.randrange(32000)
                if share and not seq.output_token_ids and "." not in seq.seq_id:
                    forks.append(seq)
        sched.update(out, sampled)
        for parent in forks:  # after the prompt: n-1 children share every prompt block
            for j in range(1, n):
                if parent.is_finished:
                    break
                child = parent.fork(f"{parent.seq_id}.{j}")
                child.replace_last_token(rng.randrange(32000))
                sched.fork(parent, child)
        used = sched.kv.stats().used
        peak = max(peak, used)
        blocks_sum += used
        steps += 1
    return {"peak_blocks": peak, "mean_blocks": round(blocks_sum / steps, 1), "steps": steps}


def window_blocks(
    *, block_size: int, window: int, contexts: list[int], chunk: int, prompt_len: int = 128
) -> dict[str, Any]:
    """Peak and final device blocks one sequence holds at each context length, with a sliding
    window on every layer and with full attention (the same replay without the window)."""
    rows = []
    for context in contexts:
        if context <= prompt_len:
            raise ValueError(
                f"every context must exceed the {prompt_len}-token prompt; got {context}"
            )
        windowed = _replay_one(block_size, window, context, chunk, prompt_len)
        full = _replay_one(block_size, None, context, chunk, prompt_len)
        rows.append(
            {
                "context_len": context,
                "windowed_peak_blocks": windowed,
                "full_peak_blocks": full,
                "blocks_saved_fraction": round(1 - windowed / full, 4),
            }
        )
    return {
        "block_size": block_size,
        "sliding_window": window,
        "prompt_len": prompt_len,
        "chunk": chunk,
        # Bound with a window: the blocks of W - 1 computed positions, plus those of one step.
        "window_bound_blocks": -(-(window - 1) // block_size) + 1 + -(-chunk // block_size),
        "rows": rows,
    }


def _replay_one(
    block_size: int, window: int | None, context: int, chunk: int, prompt_len: int
) -> int:
    """Peak blocks the sequence holds (after each step's allocation), growing to ``context``."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=context),
        CacheConfig(
            num_blocks=-(-context // block_size),
            block_size=block_size,
            enable_prefix_caching=False,
            sliding_window=window,
        ),
    )
    rng = random.Random(0)
    seq = Sequence("r", random_tokens(rng, prompt_len), max_tokens=context - prompt_len)
    sched.add(seq)
    peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        peak = max(peak, sched.kv.stats().used)
        sched.update(
            out, {s.seq_id: 0 for s, smp in zip(out.seqs, out.samples, strict=True) if smp}
        )
    return peak
