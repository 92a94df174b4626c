"""Small-batch matmuls on CPU: the native few-row linear against torch's BLAS (MKL in the PyPI
wheels), over every ``nn.Linear`` of the benchmark Llama, in forward order.

One pass multiplies ``rows`` rows by each of the model's weights in turn, as a decode step of
``rows`` sequences does (LM head included). At the default size (the 32.5M Llama of ``bench
throughput --preset 32m``: hidden 512, 9 layers, vocab 4096) the weights are ~120 MB, far more
than the last-level cache, so every pass streams them from memory as a real step does; a model
small enough to stay in cache would measure the cache instead (``weights_mb`` is reported). Each
row count is timed for both, alternating, as the median wall time of ``--iters`` passes.

Reported per row count: ms per pass for each, ``speedup`` (torch ms / native ms), the weight
stream in GB/s and the arithmetic in GFLOP/s of each, and the largest difference between the
two relative to the size of the terms (rounding: another summation order). ``linear_cpu``'s
``MAX_ROWS`` is where ``speedup`` stops being above 1 on the machines measured.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from quire_engine.bench.kernel import median_wall_ms
from quire_engine.bench.throughput import llama_config
from quire_engine.cpu import linear as linear_cpu
from quire_engine.cpu import native


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument(
        "--rows", default="1,2,4,8,12,16,24,32", help="comma-separated row counts (sequences)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    kernel = native.skinny_linear()
    if kernel is None:
        raise ValueError("the native CPU kernels are off or could not be built (see the log)")
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise ValueError(f"--rows must be comma-separated integers, got {args.rows!r}") from None
    if not rows_list or min(rows_list) < 1 or args.iters < 1 or args.warmup < 0:
        raise ValueError("--rows must be >= 1 each, --iters >= 1, --warmup >= 0")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(llama_config(args.hidden_size, args.layers, args.vocab_size, 64))
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    result: dict[str, Any] = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "num_linears": len(weights),
        "weights_mb": round(weight_bytes / 1e6, 1),
        "max_rows_routed": linear_cpu.MAX_ROWS,
        "by_rows": {},
    }
    gen = torch.Generator().manual_seed(args.seed)
    for rows in rows_list:
        entry = _measure(kernel, weights, rows, gen, args)
        for name in ("torch", "native"):
            ms = entry[f"{name}_ms"]
            entry[f"{name}_weights_gbps"] = round(weight_bytes / (ms * 1e-3) / 1e9, 2)
            entry[f"{name}_gflops"] = round(flops_per_row * rows / (ms * 1e-3) / 1e9, 1)
        entry["speedup"] = round(entry["torch_ms"] / entry["native_ms"], 3)
        result["by_rows"][str(rows)] = entry
    return result


def _measure(
    kernel: native.SkinnyLinear,
    weights: list[torch.Tensor],
    rows: int,
    gen: torch.Generator,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Best-of-three median ms per pass for torch and native, and their largest relative
    difference."""
    inputs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}
    outs = [torch.empty(rows, w.shape[0]) for w in weights]

    def torch_pass() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def native_pass() -> None:
        for w, out in zip(weights, outs, strict=True):
            kernel(inputs[w.shape[1]], w, None, out, args.threads)

    native_pass()
    worst = 0.0
    for w, out in zip(weights, outs, strict=True):
        x = inputs[w.shape[1]]
        scale = (x.abs() @ w.abs().T).clamp_min(1e-30)
        worst = max(worst, ((out - F.linear(x, w)).abs() / scale).max().item())
    times: dict[str, list[float]] = {"torch": [], "native": []}
    for _ in range(3):  # alternate, so a noisy minute hits both
        times["torch"].append(median_wall_ms(torch_pass, args.warmup, args.iters))
        times["native"].append(median_wall_ms(native_pass, args.warmup, args.iters))
    entry: dict[str, Any] = {f"{name}_ms": round(min(v), 3) for name, v in times.items()}
    entry["max_rel_diff"] = worst
    return entry
