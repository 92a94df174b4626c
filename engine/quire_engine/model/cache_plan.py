"""How big the KV pool and the step limits are for a loaded model on one rank.

What the engine decides once at start-up, from the config and the loaded model: ``max_model_len``,
the step's token budget, the pool's shape and its size in blocks (``size_pool``, below), the CPU
swap pool and the host tier under the prefix cache. Under tensor parallelism every rank sizes its
own pool from its own memory and the group takes the smallest (``Collectives.min_int``), so one
block allocator serves every rank.

Pool sizing (``size_pool``): an explicit ``num_blocks`` or ``kv_cache_memory`` wins; otherwise on
CUDA the pool gets ``total_memory * gpu_memory_utilization`` minus the weights and the activation
peak of a profiling forward pass at ``max_num_batched_tokens``; on CPU a fixed default budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from quire_engine.core.config import (
    CacheConfig,
    EngineConfig,
    KVCacheDtype,
    PreemptionMode,
    SchedulerConfig,
)
from quire_engine.core.knobs import resolved
from quire_engine.core.kv_cache_manager import max_blocks_held
from quire_engine.kernels.kv_quant import FixedScales
from quire_engine.model import attention
from quire_engine.model.cache_shape import CacheShape
from quire_engine.model.collectives import Collectives
from quire_engine.model.loader import LoadedModel

CPU_DEFAULT_KV_BYTES = 2 << 30  # like vLLM's CPU backend default KV space (it uses 4 GiB)


@dataclass(frozen=True, slots=True)
class CachePlan:
    """The engine's sub-configs with every derived value resolved (``dataclasses.replace``):
    ``scheduler`` gains ``max_model_len`` and ``max_num_batched_tokens``, ``cache`` the pool
    sizes and the model's sliding window; the parts take them as they are."""

    shape: CacheShape  # this rank's block shape (its KV heads under tensor parallelism)
    scheduler: SchedulerConfig
    cache: CacheConfig
    # An fp8 pool's per-layer checkpoint scales (None: dynamic per-token scales).
    fixed_scales: tuple[FixedScales, ...] | None = None

    @property
    def num_blocks(self) -> int:
        return resolved(self.cache.num_blocks, "num_blocks")

    @property
    def num_cpu_blocks(self) -> int:
        return self.cache.num_cpu_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.cache.num_host_blocks


def host_tier_blocks(kv_offloading_size: float, shape: CacheShape, num_ranks: int) -> int:
    """Blocks of the host tier: ``kv_offloading_size`` GiB hold a block of every rank (each
    rank's ``shape.bytes_per_block``: K, V and an 8-bit pool's scales of its KV heads), as vLLM's
    ``--kv-offloading-size`` counts all tensor-parallel ranks together."""
    return int(kv_offloading_size * 2**30) // (shape.bytes_per_block * num_ranks)


def plan_cache(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    comm: Collectives | None = None,
) -> CachePlan:
    """``ValueError`` when ``max_model_len`` exceeds the model's limit or one sequence does not
    fit. Every rank of a group must call it (it runs collectives)."""
    cache, sched = config.cache, config.scheduler
    max_len = sched.max_model_len or loaded.max_position_embeddings
    if max_len > loaded.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds {loaded.context_limit}")
    batched = sched.max_num_batched_tokens or max(2048, min(max_len, 8192))
    shape = CacheShape.of(
        loaded.model, cache.block_size, dtype, loaded.num_kv_heads, cache.kv_cache_dtype
    )
    explicit = cache.num_blocks is not None or cache.kv_cache_memory is not None
    peak = None
    if device.type == "cuda" and not explicit:
        peak = profile_peak_memory(loaded.model, batched, sched.max_num_seqs, device)
    min_blocks = max_blocks_held(max_len, batched, cache.block_size, loaded.sliding_window)

    def size(num_blocks: int | None, min_tokens: int, min_blocks: int) -> int:
        return size_pool(
            shape=shape,
            device=device,
            num_blocks=num_blocks,
            kv_cache_memory=cache.kv_cache_memory,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            profile_peak_bytes=peak,
            min_tokens=min_tokens,
            min_blocks=min_blocks,
        )

    num_blocks = cache.num_blocks
    num_cpu_blocks = 0
    if sched.preemption_mode is PreemptionMode.SWAP:
        num_cpu_blocks = int(cache.swap_space * 2**30) // shape.bytes_per_block
    num_ranks = config.parallel.tensor_parallel_size
    num_host_blocks = host_tier_blocks(cache.kv_offloading_size, shape, num_ranks)
    if comm is not None and comm.world > 1:
        # What this rank could hold, unchecked (every rank must reach the collective), then the
        # smallest share, checked on every rank alike.
        num_blocks = comm.min_int(size(num_blocks, 1, 0), device)
        num_cpu_blocks = comm.min_int(num_cpu_blocks, device)
        num_host_blocks = comm.min_int(num_host_blocks, device)
    blocks = size(num_blocks, max_len, min_blocks)
    fixed = None
    if cache.kv_cache_dtype in (KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2):
        fixed = loaded.kv_scales  # calibrated per-tensor scales win over dynamic ones
    return CachePlan(
        shape,
        dataclasses.replace(sched, max_model_len=max_len, max_num_batched_tokens=batched),
        dataclasses.replace(
            cache,
            num_blocks=blocks,
            num_cpu_blocks=num_cpu_blocks,
            num_host_blocks=num_host_blocks,
            sliding_window=loaded.sliding_window,
        ),
        fixed,
    )


def size_pool(
    *,
    shape: CacheShape,
    device: torch.device,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    profile_peak_bytes: int | None,
    min_tokens: int,
    min_blocks: int | None = None,
) -> int:
    """Number of device blocks; ``ValueError`` naming the numbers when not even one sequence of
    ``min_tokens`` (max_model_len) fits: ``min_blocks`` blocks (default: all its tokens' worth;
    fewer with a sliding window, whose sequences hold only the window's blocks)."""
    per_block = shape.bytes_per_block
    if num_blocks is not None:
        source = f"num_blocks={num_blocks}"
        blocks = num_blocks
    elif kv_cache_memory is not None:
        blocks = kv_cache_memory // per_block
        source = f"kv_cache_memory={kv_cache_memory} bytes"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        peak = profile_peak_bytes or 0
        budget = int(total * gpu_memory_utilization) - peak
        blocks = max(budget, 0) // per_block
        source = (
            f"{total / 2**30:.2f} GiB x gpu_memory_utilization={gpu_memory_utilization} "
            f"- {peak / 2**30:.2f} GiB weights and activation peak = {budget / 2**30:.2f} GiB"
        )
    else:
        blocks = CPU_DEFAULT_KV_BYTES // per_block
        source = f"the CPU default of {CPU_DEFAULT_KV_BYTES / 2**30:.0f} GiB"
    needed = -(-min_tokens // shape.block_size) if min_blocks is None else min_blocks
    if blocks < needed:
        raise ValueError(
            f"no memory left for the KV cache: {source} gives {blocks} blocks of "
            f"{shape.block_size} tokens ({per_block} bytes each), but one sequence of "
            f"max_model_len={min_tokens} tokens needs {needed}; lower max_model_len or give the "
            f"cache more memory"
        )
    return blocks


def profile_peak_memory(
    model: PreTrainedModel, num_tokens: int, num_logit_rows: int, device: torch.device
) -> int:
    """Peak CUDA bytes (weights + activations) of a plain forward over ``num_tokens`` tokens that
    computes ``num_logit_rows`` rows of logits (one per sequence that may sample in a step).

    The paged cache does not exist yet, so attention is replaced by one that outputs zeros
    (``attention.register_profiling``): the activation peak of the MLP and logits dominates, and
    the paged kernels hold no [T, T] scores. (SDPA would refuse Gemma 2; eager would count a
    [heads, T, T] matrix the engine never builds.)"""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    impl = model.config._attn_implementation
    model.set_attn_implementation(attention.register_profiling())
    try:
        with torch.inference_mode():
            ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
            rows = torch.arange(min(num_logit_rows, num_tokens), device=device)
            model(input_ids=ids, use_cache=False, logits_to_keep=rows)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    finally:
        model.set_attn_implementation(impl)
        torch.cuda.empty_cache()
