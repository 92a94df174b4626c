"""What the metrics read of the scheduler: the :class:`SchedulerStats` snapshot, the KV demand
figure in it (:func:`kv_demand_blocks`) and that figure's constant.

Pure Python, and apart from the scheduler module so that the metrics import what they read
without it. Ownership: ``Scheduler.stats()`` builds a snapshot on the thread that owns the
scheduler; a snapshot is immutable and owned by whoever holds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

from quire_engine.core.block_pool import PoolStats
from quire_engine.core.config import PreemptionMode
from quire_engine.core.host_tier import HostTierStats
from quire_engine.core.kv_cache_manager import KVCacheManager
from quire_engine.core.sequence import Sequence

# The share of a request's remaining ``max_tokens`` that KV demand expects it to still generate.
# All of it is the worst case and over-provisions when clients send a large default max_tokens;
# none of it reacts only once prompts alone fill the pool. Half sits between the two: on a ramp,
# demand crosses a 0.8 target while the pool still has room, before the first preemption.
KV_DEMAND_OUTPUT_SHARE = 0.5


class SchedulerStats(NamedTuple):
    """What the metrics read of a scheduler and its pool, taken in one piece by ``stats()`` on
    the thread that owns the scheduler (so it describes one consistent state) and then read
    anywhere. Counters are cumulative since the scheduler was made."""

    pool: PoolStats
    kv_demand_blocks: int  # see kv_demand_blocks()
    num_running: int
    num_waiting: int
    num_swapped: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache (first schedule only)
    prefix_hits: int  # of those, found
    num_preemptions: Mapping[PreemptionMode, int]  # a read-only copy
    waiting_ids: frozenset[str]  # ids of the sequences in WAITING
    host: HostTierStats | None = None  # the host tier under the prefix cache (None: no tier)
    # LoRA adapters (their lora ids, ascending) of the running and the waiting sequences.
    running_loras: tuple[int, ...] = ()
    waiting_loras: tuple[int, ...] = ()


class DemandSource(Protocol):
    """What :func:`kv_demand_blocks` reads of a scheduler (``core.scheduler.Scheduler`` is one)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def seqs(self) -> Mapping[str, Sequence]: ...


def kv_demand_blocks(scheduler: DemandSource, output_share: float = KV_DEMAND_OUTPUT_SHARE) -> int:
    """Device KV blocks this replica is committed to: the blocks in use now, plus for every
    unfinished sequence (running, waiting or swapped) the blocks it still lacks to hold its known
    tokens (prompt and output so far) and ``output_share`` of its remaining ``max_tokens``
    (capped at ``max_model_len``).

    A waiting or swapped sequence holds no device blocks, so it counts in full; a running one
    counts only its growth. Prefix-cache hits of waiting prompts are not subtracted: the figure is
    an upper bound, which is the safe side for scaling. Exported over the pool size as
    ``quire_kv_cache_demand_ratio``; above 1.0 the replica must queue or preempt.
    """
    if not 0.0 <= output_share <= 1.0:
        raise ValueError(f"output_share must be in [0, 1]; got {output_share}")
    kv = scheduler.kv
    max_len = scheduler.max_model_len
    demand = kv.stats().used
    bs, held = kv.block_size, kv.live_ids
    for seq in scheduler.seqs.values():  # every step, every sequence: plain arithmetic only
        projected = len(seq.token_ids)
        remaining = min(seq.max_tokens - len(seq.output_token_ids), max_len - projected)
        if remaining > 0:
            projected += int(output_share * remaining)
        lacking = -(-projected // bs) - len(held(seq.seq_id))
        if lacking > 0:
            demand += lacking
    return demand
