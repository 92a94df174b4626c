"""The pure-Python engine parts the core tests build, each from one factory: a ``Scheduler`` and a
``KVCacheManager`` over small pools, sized by keywords (no model, no torch), and ``ids`` to read
a block table as a list.

Each test passes the sizes its exact block counts rest on; the defaults are the common small case
(blocks of 4 tokens, prefix caching on, no swap pool). The factories own nothing: every call
builds fresh parts.
"""

from __future__ import annotations

from collections.abc import Iterable

from quire_engine.core.config import CacheConfig, PreemptionMode, SchedulerConfig
from quire_engine.core.kv_cache_manager import KVCacheManager
from quire_engine.core.scheduler import Scheduler


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    mode: PreemptionMode | str = PreemptionMode.RECOMPUTE,
    num_cpu_blocks: int = 0,
    prefix: bool = True,
    sliding_window: int | None = None,
    num_host_blocks: int = 0,
) -> Scheduler:
    """A scheduler over a pool of ``num_blocks`` blocks of ``block_size`` tokens (and a host
    tier of ``num_host_blocks`` under its prefix cache)."""
    return Scheduler(
        SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, max_model_len, PreemptionMode.parse(mode)
        ),
        CacheConfig(
            num_blocks,
            block_size,
            prefix,
            num_cpu_blocks,
            sliding_window,
            num_host_blocks=num_host_blocks,
        ),
    )


def make_kv_cache(
    num_blocks: int = 8,
    block_size: int = 4,
    *,
    enable_prefix_caching: bool = True,
    num_cpu_blocks: int = 0,
    sliding_window: int | None = None,
    num_host_blocks: int = 0,
) -> KVCacheManager:
    """A KV cache manager (block tables over one pool, and a host tier of
    ``num_host_blocks``) without a scheduler."""
    return KVCacheManager(
        CacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            sliding_window=sliding_window,
            num_host_blocks=num_host_blocks,
        )
    )


def ids(table: Iterable[int] | None) -> list[int] | None:
    """A block table (int32 array) as a list, for comparisons."""
    return None if table is None else [int(block) for block in table]
