"""Decode attention bandwidth: the paged Triton kernel against torch SDPA on a contiguous cache.

``--device cpu`` measures the engine's CPU decode path instead (fp32, ``--threads`` torch
threads, wall-clock medians): the native kernel (``cpu/native``, blocks read in place)
against the torch path it replaces (``CpuAttentionPlan`` without it: gather the blocks, then
SDPA) and against SDPA over a contiguous cache, with the same byte count. With
``--kv-cache-dtype`` (int8, fp8 = fp8_e4m3, fp8_e5m2, or ``all``) it measures the native
kernel instead on a float32 pool and on the same K/V quantized into each 8-bit format asked
for (``kv_quant``: a byte per element plus a float32 scale per token and KV head), side by
side: time per call and per decoded token, bytes read, and each 8-bit format's error against
the torch reference on the same 8-bit pools and against float32.

Default shape (issue 3): 64 sequences decoding one token each over 2,048 cached positions, 32 query
heads sharing 8 KV heads of size 128, bfloat16, 16-token blocks. Decode attention reads every
cached K and V once and does little arithmetic per byte, so it is bandwidth-bound and the figure
of merit is bytes moved per second:

    bytes = K and V read (batch * context * kv_heads * head_dim * 2 tensors * dtype bytes)
            + q read + out written (batch * heads * head_dim * dtype bytes each)

The same count is used for SDPA, which reads the same K/V from a contiguous
``[batch, kv_heads, context, head_dim]`` copy (GQA through ``enable_gqa``, no K/V repetition).
The paged cache's blocks are shuffled over the pool, as after a while of serving. Both read
about 0.5 GB per call at the default shape, far more than the GPU's L2, so repeated calls are
not served from cache. Each call is timed with its own pair of CUDA events; the median is kept.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from quire_engine.cpu import native
from quire_engine.cpu.paged_attention import CpuAttentionPlan
from quire_engine.kernels.kv_quant import SCALE_DTYPE, quantize
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_triton import choose_num_splits, paged_attention
from quire_engine.kernels.triton_runtime import triton_usable

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --kv-cache-dtype (the serve flag's names; "all": every 8-bit format) -> the formats measured.
KV_FORMATS = {
    "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}  # fmt: skip
KV_CHOICES = ("auto", "fp8", *KV_FORMATS, "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=2048, help="cached positions per sequence")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--num-splits", type=int, default=None, help="split-KV count (default: the launcher's)"
    )
    parser.add_argument(
        "--peak-gbps", type=float, default=4800.0, help="GPU memory bandwidth peak (H200: 4800)"
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the native CPU kernel"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (--device cpu)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CHOICES,
        default="auto",
        help="--device cpu: the native kernel on float32 and on these 8-bit pools, side by side "
        "(all: int8, fp8_e4m3, fp8_e5m2)",
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)


def _median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _validate(args: argparse.Namespace) -> None:
    for name in (
        "batch",
        "context",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "iters",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_heads % args.num_kv_heads:
        raise ValueError(
            f"--num-heads ({args.num_heads}) must be a multiple of --num-kv-heads "
            f"({args.num_kv_heads})"
        )
    if args.warmup < 0 or args.peak_gbps <= 0:
        raise ValueError("--warmup must be >= 0 and --peak-gbps > 0")
    if args.kv_cache_dtype != "auto" and args.device != "cpu":
        raise ValueError("--kv-cache-dtype is measured with --device cpu (the native kernel)")
    if args.device == "cpu":
        if args.dtype != "fp32" or args.threads < 1:
            raise ValueError("--device cpu runs the native kernel: --dtype fp32, --threads >= 1")
        if native.paged_decode() is None:
            raise ValueError("--device cpu: the native kernel did not build (see the log)")
        return
    if not torch.cuda.is_available():
        raise ValueError(
            "bench kernel needs a CUDA GPU and none is visible (torch.cuda.is_available() is "
            "False); the Triton kernel is tested on CPU by the interpreter tests instead"
        )
    if not triton_usable("cuda"):
        raise ValueError("bench kernel needs triton with CUDA (is triton installed?)")


@dataclass(frozen=True)
class _Problem:
    """One decode batch over a shuffled paged pool, and the same cache laid out contiguously."""

    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, blocks_per_seq]: a random permutation of blocks
    q: torch.Tensor  # [batch, heads, D]: one decode token per sequence
    k_contig: torch.Tensor  # [batch, kv_heads, context, D]
    v_contig: torch.Tensor
    scale: float


def _problem(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> _Problem:
    batch, context, block_size = args.batch, args.context, args.block_size
    gen = torch.Generator(device=device).manual_seed(args.seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    k_cache = randn(num_blocks, block_size, args.num_kv_heads, args.head_dim)
    v_cache = randn(num_blocks, block_size, args.num_kv_heads, args.head_dim)
    block_tables = (  # each sequence's blocks lie anywhere in the pool
        torch.randperm(num_blocks, generator=gen, device=device)
        .view(batch, blocks_per_seq)
        .to(torch.int32)
    )
    q = randn(batch, args.num_heads, args.head_dim)

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # -> [batch, kv_heads, context, D]
        gathered = cache[block_tables.long()].flatten(1, 2)[:, :context]
        return gathered.transpose(1, 2).contiguous()

    return _Problem(
        k_cache, v_cache, block_tables, q, contiguous(k_cache), contiguous(v_cache),
        args.head_dim**-0.5,
    )  # fmt: skip


def _shape(args: argparse.Namespace, elem: int) -> dict[str, Any]:
    """The fields both devices report, with the byte count of one call (see the docstring)."""
    kv_bytes = 2 * args.batch * args.context * args.num_kv_heads * args.head_dim * elem
    return {
        "batch": args.batch,
        "context": args.context,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "bytes_per_call": kv_bytes + 2 * args.batch * args.num_heads * args.head_dim * elem,
    }


def median_wall_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median wall-clock ms of ``iters`` calls after ``warmup`` (CPU work: no device sync)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    kernel = native.paged_decode()
    assert kernel is not None  # _validate checked
    pb = _problem(args, torch.device("cpu"), torch.float32)
    batch = args.batch
    plan_args = {
        "slots": np.zeros(batch, dtype=np.int64),  # unused: nothing is written
        "block_tables": pb.block_tables.numpy(),
        "seq_lens": np.full(batch, args.context, dtype=np.int64),
        "query_start_loc": np.arange(batch + 1, dtype=np.int64),
        "block_size": args.block_size,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
    }
    # Plans are built once: the engine builds one per step and replays it in every layer.
    native_plan = CpuAttentionPlan.build(**plan_args, native=kernel, num_threads=args.threads)
    torch_plan = CpuAttentionPlan.build(**plan_args)
    q, k_cache, v_cache, scale = pb.q, pb.k_cache, pb.v_cache, pb.scale

    def sdpa() -> torch.Tensor:  # [batch, heads, D] over [batch, kv_heads, context, D]
        return F.scaled_dot_product_attention(
            q[:, :, None], pb.k_contig, pb.v_contig, scale=scale, enable_gqa=True
        )[:, :, 0]

    calls = {
        "native": lambda: native_plan.attend(q, k_cache, v_cache, scale),
        "torch_plan": lambda: torch_plan.attend(q, k_cache, v_cache, scale),
        "sdpa_contiguous": sdpa,
    }
    reference = sdpa()
    max_abs_diff = max((calls[n]() - reference).abs().max().item() for n in calls)
    shape = _shape(args, 4)
    result: dict[str, Any] = {
        "device": "cpu",
        "dtype": "fp32",
        "threads": args.threads,
        **shape,
        "kernel_flags": " ".join(kernel.flags),
    }
    for name, fn in calls.items():
        ms = median_wall_ms(fn, args.warmup, args.iters)
        result[f"{name}_ms"] = round(ms, 4)
        result[f"{name}_gbps"] = round(shape["bytes_per_call"] / (ms * 1e-3) / 1e9, 2)
    result["native_speedup_vs_torch_plan"] = round(result["torch_plan_ms"] / result["native_ms"], 3)
    result["native_speedup_vs_sdpa"] = round(result["sdpa_contiguous_ms"] / result["native_ms"], 3)
    result["max_abs_diff_vs_sdpa"] = max_abs_diff
    return result


def _kv_formats(choice: str) -> list[str]:
    if choice == "all":
        return list(KV_FORMATS)
    return ["fp8_e4m3" if choice == "fp8" else choice]


def _quantized(cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` quantized as the engine's write does (``kv_quant``), a few blocks at a time
    (the whole pool at once would need several float32 copies of it)."""
    data = torch.empty(cache.shape, dtype=dtype)
    scales = torch.empty(cache.shape[:3], dtype=SCALE_DTYPE)
    for i in range(0, cache.shape[0], 256):
        data[i : i + 256], scales[i : i + 256] = quantize(cache[i : i + 256], dtype)
    return data, scales


def _run_cpu_kv8(args: argparse.Namespace) -> dict[str, Any]:
    """The native kernel per call and per decoded token on float32 and 8-bit pools of the same
    K/V (see the module docstring); errors on the first few sequences, where the torch paths
    are cheap."""
    torch.set_num_threads(args.threads)
    kernel = native.paged_decode()
    assert kernel is not None  # _validate checked
    batch, context, kv_heads, head_dim = args.batch, args.context, args.num_kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(args.seed)
    blocks_per_seq = -(-context // args.block_size)
    shape = (batch * blocks_per_seq, args.block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(shape[0], generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch, args.num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    check = min(batch, 4)  # sequences whose outputs are compared
    plan_args = {
        "slots": np.zeros(check, dtype=np.int64),  # unused: nothing is written
        "block_tables": tables[:check].numpy(),
        "seq_lens": np.full(check, context, dtype=np.int64),
        "query_start_loc": np.arange(check + 1, dtype=np.int64),
        "block_size": args.block_size,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
    }
    native_plan = CpuAttentionPlan.build(**plan_args, native=kernel, num_threads=args.threads)
    torch_plan = CpuAttentionPlan.build(**plan_args)
    full_plan = CpuAttentionPlan.build(
        **{**plan_args, "slots": np.zeros(batch, dtype=np.int64),
           "block_tables": tables.numpy(), "seq_lens": np.full(batch, context, dtype=np.int64),
           "query_start_loc": np.arange(batch + 1, dtype=np.int64)},
        native=kernel, num_threads=args.threads,
    )  # fmt: skip
    fp32_out = native_plan.attend(q[:check], k_cache, v_cache, scale)
    tokens = batch * context * kv_heads  # (token, KV head) rows of K, and of V, read per call
    qo_bytes = 2 * batch * args.num_heads * head_dim * 4  # q read, out written (fp32)
    formats: dict[str, dict[str, Any]] = {}
    for name in ["fp32", *_kv_formats(args.kv_cache_dtype)]:
        pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        if name == "fp32":
            pools = (k_cache, v_cache, None, None)
            kv_bytes = 2 * tokens * head_dim * 4
        else:
            (kq, ks), (vq, vs) = (_quantized(c, KV_FORMATS[name]) for c in (k_cache, v_cache))
            pools = (kq, vq, ks, vs)
            kv_bytes = 2 * tokens * (head_dim + SCALE_DTYPE.itemsize)
        kc, vc, ks8, vs8 = pools
        call = functools.partial(full_plan.attend, q, kc, vc, scale, k_scale=ks8, v_scale=vs8)
        ms = median_wall_ms(call, args.warmup, args.iters)
        row: dict[str, Any] = {
            "bytes_per_call": kv_bytes + qo_bytes,
            "native_ms": round(ms, 4),
            "us_per_token": round(ms * 1e3 / batch, 3),  # one call: one token of each sequence
            "gbps": round((kv_bytes + qo_bytes) / (ms * 1e-3) / 1e9, 2),
        }
        if name != "fp32":
            got = native_plan.attend(q[:check], kc, vc, scale, k_scale=ks8, v_scale=vs8)
            want = torch_plan.attend(q[:check], kc, vc, scale, k_scale=ks8, v_scale=vs8)
            row["speedup_vs_fp32"] = round(formats["fp32"]["native_ms"] / ms, 3)
            row["bytes_vs_fp32"] = round(
                row["bytes_per_call"] / formats["fp32"]["bytes_per_call"], 4
            )
            row["max_abs_diff_vs_reference"] = (got - want).abs().max().item()
            row["max_abs_diff_vs_fp32"] = (got - fp32_out).abs().max().item()
        formats[name] = row
    return {
        "device": "cpu",
        "threads": args.threads,
        "batch": batch,
        "context": context,
        "num_heads": args.num_heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "block_size": args.block_size,
        "kernel_flags": " ".join(kernel.flags),
        "kv_formats": formats,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    _validate(args)
    if args.device == "cpu" and args.kv_cache_dtype != "auto":
        return _run_cpu_kv8(args)
    if args.device == "cpu":
        return _run_cpu(args)
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    batch, context, kv_heads = args.batch, args.context, args.num_kv_heads
    pb = _problem(args, device, dtype)
    q, k_cache, v_cache, block_tables, scale = (
        pb.q, pb.k_cache, pb.v_cache, pb.block_tables, pb.scale
    )  # fmt: skip
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q_sdpa = q[:, :, None, :]  # [batch, heads, 1, D]
    num_splits = args.num_splits or choose_num_splits(
        batch, kv_heads, 1, context, torch.cuda.get_device_properties(device).multi_processor_count
    )

    inputs = PagedAttentionInputs(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, 1, context
    )

    def paged() -> torch.Tensor:
        return paged_attention(inputs, num_splits=num_splits)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_sdpa, pb.k_contig, pb.v_contig, scale=scale, enable_gqa=True
        )

    max_abs_diff = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
    paged_ms = _median_ms(paged, args.warmup, args.iters)
    sdpa_ms = _median_ms(sdpa, args.warmup, args.iters)
    shape = _shape(args, torch.finfo(dtype).bits // 8)

    def gbps(ms: float) -> float:
        return shape["bytes_per_call"] / (ms * 1e-3) / 1e9

    return {
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        **shape,
        "num_splits": num_splits,
        "peak_gbps": args.peak_gbps,
        "paged_ms": round(paged_ms, 4),
        "paged_gbps": round(gbps(paged_ms), 1),
        "paged_fraction_of_peak": round(gbps(paged_ms) / args.peak_gbps, 3),
        "sdpa_ms": round(sdpa_ms, 4),
        "sdpa_gbps": round(gbps(sdpa_ms), 1),
        "sdpa_fraction_of_peak": round(gbps(sdpa_ms) / args.peak_gbps, 3),
        "paged_speedup_vs_sdpa": round(sdpa_ms / paged_ms, 3),
        "max_abs_diff_vs_sdpa": max_abs_diff,
    }
