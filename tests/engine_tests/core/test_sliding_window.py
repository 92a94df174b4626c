"""Sliding-window block release: exact block tables, ref counts and free-queue order while a
sequence outgrows its window, across prefix hits, fork, swap and free (pure Python), and the
scheduler releasing blocks as sequences advance."""

from __future__ import annotations

from pathlib import Path

import pytest

from quire_engine.core.config import CacheConfig
from quire_engine.core.kv_cache_manager import RELEASED, KVCacheManager
from quire_engine.core.sequence import Sequence
from tests.engine_tests.factories import make_kv_cache, make_scheduler

WINDOW = 6  # tokens: with blocks of 4, a block is dead once 6 newer tokens follow it


def grow(kv: KVCacheManager, s: Sequence, n: int) -> list[int]:
    """Compute ``n`` more tokens of ``s`` (appending tokens as needed) and release as the
    scheduler does after a step."""
    while len(s.token_ids) < s.num_computed_tokens + n:
        s.append_token(len(s.token_ids) + 100)
    ids = kv.allocate_slots(s, n)
    assert ids is not None
    s.num_computed_tokens += n
    kv.release_out_of_window(s)
    return list(kv.block_ids(s.seq_id))


def test_leading_blocks_released_once_out_of_window() -> None:
    kv = make_kv_cache(sliding_window=WINDOW)  # window 6, blocks of 4
    s = Sequence("a", list(range(9)), max_tokens=32)
    # 9 computed: the next query (position 9) sees 4..9; block 0 (0..3) is dead.
    assert grow(kv, s, 9) == [RELEASED.block_id, 1, 2]
    assert kv.num_held("a") == 2 and kv.num_released == 1
    assert kv.ref_counts("a") == [0, 1, 1]
    assert kv.pool.free_queue.block_ids()[-1] == 0  # freed to the tail
    # 10 computed: the next query sees 5..10: block 1 (4..7) is still needed.
    assert grow(kv, s, 1) == [RELEASED.block_id, 1, 2]
    # 11 computed: it sees 6..11: still block 1. 13 computed: sees 8..13: block 1 is dead.
    assert grow(kv, s, 1) == [RELEASED.block_id, 1, 2]
    assert grow(kv, s, 2) == [RELEASED.block_id, RELEASED.block_id, 2, 3]
    assert kv.num_held("a") == 2 and kv.stats().used == 2
    kv.free("a")
    assert kv.stats().used == 0


def test_no_window_releases_nothing() -> None:
    kv = make_kv_cache()
    s = Sequence("a", list(range(30)), max_tokens=4)
    assert grow(kv, s, 30) == list(range(8))
    assert kv.num_released == 0
    kv.free("a")


def test_released_block_stays_cached_for_a_prefix_hit() -> None:
    kv = make_kv_cache(sliding_window=WINDOW)
    a = Sequence("a", list(range(12)), max_tokens=4)
    grow(kv, a, 12)  # sees 7..12 next: blocks 0 (0..3) released, 1 (4..7) kept
    assert kv.block_ids("a") == [RELEASED.block_id, 1, 2]
    b = Sequence("b", list(range(12)), max_tokens=4)
    hits = kv.computed_blocks(b)  # the released block 0 still holds its hash
    assert [h.block_id for h in hits] == [0, 1]
    computed = kv.allocate_with_prefix(b, 4, hits)  # as the scheduler does
    assert computed is not None
    b.num_computed_tokens = computed
    assert b.num_computed_tokens == 8
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.ref_counts("b") == [1, 2, 1]
    b.num_computed_tokens += 4
    kv.release_out_of_window(b)
    assert kv.block_ids("b") == [RELEASED.block_id, 1, 3]
    kv.free("a")
    kv.free("b")
    assert kv.stats().used == 0


def test_fork_shares_only_live_blocks() -> None:
    kv = make_kv_cache(sliding_window=WINDOW)
    a = Sequence("a", list(range(10)), max_tokens=8)
    grow(kv, a, 10)
    assert kv.block_ids("a") == [RELEASED.block_id, 1, 2]
    child = a.fork("a.1")
    kv.fork(a, child)
    assert kv.block_ids("a.1") == [RELEASED.block_id, 1, 2]
    assert kv.ref_counts("a") == [0, 2, 2]
    kv.free("a")
    assert kv.ref_counts("a.1") == [0, 1, 1]
    kv.free("a.1")
    assert kv.stats().used == 0


def test_swap_moves_only_live_blocks_and_keeps_positions() -> None:
    kv = make_kv_cache(num_cpu_blocks=4, sliding_window=WINDOW)
    s = Sequence("a", list(range(14)), max_tokens=8)
    grow(kv, s, 14)  # sees 9..14 next: blocks 0 and 1 released
    assert kv.block_ids("a") == [RELEASED.block_id, RELEASED.block_id, 2, 3]
    assert kv.swap_out("a") == [(2, 0), (3, 1)]
    assert kv.cpu_block_ids("a") == [RELEASED.block_id, RELEASED.block_id, 0, 1]
    assert kv.stats().used == 0 and kv.cpu_pool.stats().used == 2
    # Two live blocks come back (the two released ones need no room).
    assert kv.can_swap_in("a", extra_blocks=6) and not kv.can_swap_in("a", extra_blocks=7)
    moves = kv.swap_in("a")
    assert [c for c, _ in moves] == [0, 1]
    table = kv.block_ids("a")
    assert table[:2] == [RELEASED.block_id] * 2 and table[2:] == [d for _, d in moves]
    assert kv.cpu_pool.stats().used == 0
    assert grow(kv, s, 1)[:2] == [RELEASED.block_id] * 2
    kv.free("a")
    assert kv.stats().used == 0


def test_scheduler_releases_blocks_as_sequences_advance() -> None:
    """Blocks held per sequence stop growing at the window's worth while the context grows."""
    sched = make_scheduler(max_num_seqs=4, max_model_len=256, sliding_window=10)
    s = Sequence("a", list(range(20)), max_tokens=100)
    sched.add(s)
    held = []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {"a": 7})
        held.append(sched.kv.num_held("a"))
    # After each step the next query (position c) needs the 9 computed positions c-9..c-1:
    # at most 3 blocks of 4, whatever the context length (20 up to 119).
    assert max(held) == 3 and held[-1] == 0  # (0: finished and freed)
    # At the last step 119 positions are computed: (119 - 10 + 1) // 4 = 27 blocks released.
    assert sched.kv.num_released == 27
    assert sched.kv.stats().used == 0


@pytest.mark.parametrize("window", [0, -3])
def test_cache_config_rejects_bad_window(window: int) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        CacheConfig(num_blocks=4, sliding_window=window)


def test_bench_allocator_window_figure() -> None:
    """``bench allocator --sliding-window``: blocks held stop growing at the window's worth."""
    from quire_engine.bench.allocator import window_blocks

    result = window_blocks(block_size=16, window=256, contexts=[200, 1024, 4096], chunk=64)
    rows = {r["context_len"]: r for r in result["rows"]}
    # Shorter than the window: nothing to release, both hold every block (200 / 16 -> 13).
    assert rows[200]["windowed_peak_blocks"] == rows[200]["full_peak_blocks"] == 13
    # Past it, full attention holds the whole context; the window holds its 255 computed
    # positions (16 blocks) plus the one being filled.
    assert rows[1024]["full_peak_blocks"] == 64 and rows[4096]["full_peak_blocks"] == 256
    assert rows[1024]["windowed_peak_blocks"] == rows[4096]["windowed_peak_blocks"] == 17
    assert result["window_bound_blocks"] >= 17
    with pytest.raises(ValueError, match="exceed"):
        window_blocks(block_size=16, window=256, contexts=[100], chunk=64)


def test_prefix_hits_before_the_window_are_not_taken() -> None:
    kv = make_kv_cache(12, sliding_window=WINDOW)  # window 6, blocks of 4
    a = Sequence("a", list(range(20)), max_tokens=4)
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20  # (not released: a's tables stay whole for this test)
    b = Sequence("b", list(range(20)), max_tokens=4)
    hits = kv.computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1, 2, 3]  # 19 tokens may hit: 4 full blocks
    # b continues at position 16, which sees 11..16: blocks 0 and 1 (0..7) are never read.
    cached = kv.allocate_with_prefix(b, 4, hits)
    assert kv.block_ids("b") == [RELEASED.block_id] * 2 + [2, 3, 5]
    assert cached == 16 and kv.num_held("b") == 3
    assert kv.ref_counts("a") == [1, 1, 2, 2, 1]
    kv.free("a")
    kv.free("b")
    assert kv.stats().used == 0


@pytest.mark.parametrize(
    ("tokens", "step", "window", "expected"),
    [
        (100, 16, None, 25),  # full attention: every block
        (100, 16, 8, 7),  # (16 + 8 - 1) positions span at most ceil(23 / 4) + 1 blocks
        (100, 100, 8, 25),  # a whole-prompt step needs them all anyway
        (10, 16, 8, 3),  # never more than the sequence's own blocks
    ],
)
def test_max_blocks_held(tokens: int, step: int, window: int | None, expected: int) -> None:
    assert make_kv_cache(sliding_window=window).max_blocks_held(tokens, step) == expected


def test_scheduler_admits_contexts_longer_than_the_pool() -> None:
    """With a window, a request whose context exceeds the whole pool runs: it never holds more
    than the window's blocks plus one step's."""
    sched = make_scheduler(
        6, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=400, sliding_window=10
    )
    s = Sequence("a", list(range(30)), max_tokens=300)  # 330 tokens, pool of 24 slots
    sched.add(s)
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.preempted
        sched.update(
            out, {x.seq_id: 1 for x, smp in zip(out.seqs, out.samples, strict=True) if smp}
        )
    assert len(s.token_ids) == 330 and sched.kv.stats().used == 0
    full = make_scheduler(6, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=400)
    with pytest.raises(ValueError, match="needs up to 83 KV blocks"):
        full.add(Sequence("b", list(range(30)), max_tokens=300))


def test_engine_serves_contexts_longer_than_its_pool(model_dirs: dict[str, Path]) -> None:
    """Mistral (window 20 on every layer) with a pool of 6 blocks of 8 (48 slots) and steps of at
    most 16 tokens: prompts up to 64 tokens growing to 88 stay token-exact against transformers,
    log-probabilities within 1e-4."""
    from quire_engine import LLM, SamplingParams
    from tests.engine_tests.model.test_llm_equivalence import (
        LOGPROB_TOLERANCE,
        MAX_TOKENS,
        hf_reference,
        prompts,
    )

    reference = hf_reference(str(model_dirs["mistral"]))
    llm = LLM(
        str(model_dirs["mistral"]), device="cpu", block_size=8, num_blocks=6, max_model_len=128,
        max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    results = llm.generate(prompts(), params)
    for ref, result in zip(reference, results, strict=True):
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        assert out.logprobs is not None
        for step, top in enumerate(out.logprobs):
            for token, logprob in top.items():
                assert abs(logprob - float(ref.logprobs[step, token])) <= LOGPROB_TOLERANCE
    assert llm.engine.scheduler.kv.num_released > 0
    assert llm.kv_cache_stats().used == 0
