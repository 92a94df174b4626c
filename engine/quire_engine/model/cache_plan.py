"""How big the KV pool and the step limits are for a loaded model on one rank.

What the engine decides once at start-up, from the config and the loaded model: ``max_model_len``,
the step's token budget, the pool's shape and its size in blocks (``runner.size_pool``), the CPU
swap pool and the host tier under the prefix cache. Under tensor parallelism every rank sizes its
own pool from its own memory and the group takes the smallest (``Collectives.min_int``), so one
block allocator serves every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

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
from quire_engine.model.collectives import Collectives
from quire_engine.model.loader import LoadedModel
from quire_engine.model.runner import CacheShape, profile_peak_memory, size_pool


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
