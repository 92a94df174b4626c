"""KV demand: blocks in use plus what unfinished requests still need, with exact block counts.

Pool of 16 blocks of 4 tokens; a fake model appends deterministic tokens (as in the scheduler
tests) so every count below follows from the arithmetic in the comments.
"""

from __future__ import annotations

import pytest

from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from quire_engine.core.stats import KV_DEMAND_OUTPUT_SHARE, kv_demand_blocks
from quire_engine.engine.metrics import EngineFacts, ServerMetrics
from quire_engine.engine.recorder import StatsRecorder
from tests.engine_tests.factories import make_scheduler

POOL = 16  # blocks of 4 tokens


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sampled = {s.seq_id: 7 for s, smp in zip(out.seqs, out.samples, strict=True) if smp}
    for seq in sched.update(out, sampled):
        assert seq.status is SequenceStatus.FINISHED


def finish_all(sched: Scheduler) -> None:
    for seq in list(sched.seqs.values()):
        sched.finish(seq, FinishReason.ABORT)


def test_share_is_documented_default() -> None:
    assert KV_DEMAND_OUTPUT_SHARE == 0.5


def test_empty_scheduler_demands_nothing() -> None:
    assert kv_demand_blocks(make_scheduler(POOL)) == 0


def test_waiting_requests_count_prompt_plus_half_their_output() -> None:
    sched = make_scheduler(POOL)
    # A: 6 prompt tokens + 0.5 * 10 = 11 tokens -> 3 blocks. B: 8 + 0.5 * 4 = 10 -> 3 blocks.
    sched.add(Sequence("a", [1] * 6, max_tokens=10))
    sched.add(Sequence("b", [2] * 8, max_tokens=4))
    assert sched.kv.stats().used == 0
    assert kv_demand_blocks(sched) == 6
    # Only prompts (share 0): 2 + 2 blocks; the whole max_tokens (share 1): 16 -> 4, 12 -> 3.
    assert kv_demand_blocks(sched, output_share=0.0) == 4
    assert kv_demand_blocks(sched, output_share=1.0) == 7
    finish_all(sched)


def test_running_requests_count_only_their_growth() -> None:
    sched = make_scheduler(POOL)
    sched.add(Sequence("a", [1] * 6, max_tokens=10))
    sched.add(Sequence("b", [2] * 8, max_tokens=4))
    step(sched)
    # Both prefilled: a holds 2 blocks (6 tokens), b holds 2 (8 tokens); each now has 1 output
    # token. a: 7 + int(0.5 * 9) = 11 tokens -> 3 blocks, lacks 1; b: 9 + int(0.5 * 3) = 10 -> 3,
    # lacks 1. Used 4 + 2.
    assert sched.kv.stats().used == 4
    assert kv_demand_blocks(sched) == 6
    # Usage alone says 4/16 = 0.25 while the pool is committed to 6/16.
    step(sched)
    step(sched)
    # a: 9 tokens, 8 computed in 2 blocks, 3 output -> 9 + int(0.5 * 7) = 12 -> 3, lacks 1.
    # b: 11 tokens, 10 computed in 3 blocks, 3 output -> 11 + int(0.5 * 1) = 11 -> 3, lacks 0.
    assert [len(sched.kv.block_ids(s)) for s in ("a", "b")] == [2, 3]
    assert kv_demand_blocks(sched) == 5 + 1
    finish_all(sched)


def test_max_model_len_caps_the_projection() -> None:
    sched = make_scheduler(num_blocks=64, max_model_len=32)
    # 6 prompt tokens, max_tokens 1000 but only 26 more fit: 6 + 13 = 19 tokens -> 5 blocks.
    sched.add(Sequence("a", [1] * 6, max_tokens=1000))
    assert kv_demand_blocks(sched) == 5
    assert kv_demand_blocks(sched, output_share=1.0) == 8  # 32 tokens
    finish_all(sched)


def test_preempted_request_counts_in_full_again() -> None:
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens, max_tokens 8: each takes 2 blocks
    # after prefill, and the pool is full once both reach 9 tokens (3 blocks each > 4 in all).
    sched = make_scheduler(num_blocks=4)
    sched.add(Sequence("a", [1] * 7, max_tokens=8))
    sched.add(Sequence("b", [2] * 7, max_tokens=8))
    while not any(sched.num_preemptions.values()):
        step(sched)
    victim = sched.seqs["b"]
    assert victim.status is SequenceStatus.WAITING and sched.kv.block_ids("b") == []
    a = sched.seqs["a"]
    expected = sched.kv.stats().used
    for seq in (a, victim):
        remaining = seq.max_tokens - len(seq.output_token_ids)
        projected = sched.kv.num_blocks_for(seq.num_tokens + remaining // 2)
        expected += max(0, projected - len(sched.kv.block_ids(seq.seq_id)))
    # b holds nothing, so its whole projection (>= 3 blocks) is on top of a's use: over the pool.
    assert kv_demand_blocks(sched) == expected
    assert expected > sched.kv.stats().total
    finish_all(sched)


def test_gauge_exports_demand_over_pool_size() -> None:
    sched = make_scheduler(POOL)
    metrics = ServerMetrics("m")
    facts = EngineFacts(sched.max_model_len, sched.cache_config, 0.9, 0.0)
    recorder = StatsRecorder(metrics, sched.stats(), facts)

    def sample(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m"})

    assert sample("quire_kv_cache_demand_ratio") == 0.0
    sched.add(Sequence("a", [1] * 6, max_tokens=10))
    sched.add(Sequence("b", [2] * 8, max_tokens=4))
    recorder.refresh(sched.stats())
    assert sample("quire_kv_cache_demand_ratio") == 6 / 16
    assert sample("quire_kv_cache_usage_ratio") == 0.0
    finish_all(sched)
    recorder.refresh(sched.stats())
    assert sample("quire_kv_cache_demand_ratio") == 0.0


def test_share_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="output_share"):
        kv_demand_blocks(make_scheduler(POOL), output_share=1.5)
