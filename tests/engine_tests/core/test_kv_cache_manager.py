"""Exact-state tests of block tables: growth, prefix reuse, salts, fork + copy-on-write, swap."""

from __future__ import annotations

import pytest

from quire_engine.core.kv_cache_manager import hash_block
from quire_engine.core.sequence import Sequence
from tests.engine_tests.factories import ids, make_kv_cache


def seq(seq_id: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, list(tokens), max_tokens=16, cache_salt=salt)


def test_blocks_taken_on_demand_and_returned_deepest_first() -> None:
    kv = make_kv_cache()
    s = seq("a", list(range(10)))  # 10 tokens -> 3 blocks of 4
    assert ids(kv.allocate_slots(s, 10)) == [0, 1, 2]
    assert kv.stats().used == 3
    s.num_computed_tokens = 10
    # Growth within the tail block takes nothing; crossing a boundary takes one block.
    s.append_token(10)
    assert ids(kv.allocate_slots(s, 1)) == [0, 1, 2]
    s.num_computed_tokens = 11
    s.append_token(11)
    assert ids(kv.allocate_slots(s, 1)) == [0, 1, 2]
    s.num_computed_tokens = 12
    s.append_token(12)
    assert ids(kv.allocate_slots(s, 1)) == [0, 1, 2, 3]
    kv.free("a")
    assert kv.stats().used == 0
    # Deepest block first at the tail of the free queue.
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]


def test_allocation_failure_changes_nothing() -> None:
    kv = make_kv_cache(num_blocks=2)
    s = seq("a", list(range(12)))
    assert kv.allocate_slots(s, 12) is None
    assert kv.stats().used == 0 and kv.block_ids("a") == []


def test_prefix_hit_reuses_longest_chain_and_recomputes_last_token() -> None:
    kv = make_kv_cache()
    a = seq("a", list(range(12)))
    assert ids(kv.allocate_slots(a, 12)) == [0, 1, 2]
    a.num_computed_tokens = 12
    # Same 12 tokens: at most 11 may hit, so 2 full blocks are reused and block 3 is new.
    b = seq("b", list(range(12)))
    hits = kv.computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    cached = kv.allocate_with_prefix(b, 12 - 8, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert cached == 8
    assert kv.ref_counts("a") == [2, 2, 1]
    # A prompt diverging inside block 1 hits only block 0.
    c = seq("c", [0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert [blk.block_id for blk in kv.computed_blocks(c)] == [0]
    for sid in ("a", "b"):
        kv.free(sid)
    assert kv.stats().used == 0 and kv.stats().cached_free == 3


def test_freed_cached_blocks_are_revived_after_finish() -> None:
    kv = make_kv_cache()
    a = seq("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.free("a")
    b = seq("b", list(range(9)))
    hits = kv.computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert kv.allocate_with_prefix(b, 1, hits) == 8
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.stats().cached_free == 0
    kv.free("b")


def test_salt_isolates_tenants() -> None:
    kv = make_kv_cache()
    a = seq("a", list(range(9)), salt="tenant-a")
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    assert kv.computed_blocks(seq("b", list(range(9)), salt="tenant-b")) == []
    assert kv.computed_blocks(seq("c", list(range(9)))) == []
    assert len(kv.computed_blocks(seq("d", list(range(9)), salt="tenant-a"))) == 2
    kv.free("a")


def test_hash_chains_parent() -> None:
    h0 = hash_block(None, [1, 2], None)
    assert hash_block(h0, [3, 4], None) != hash_block(None, [3, 4], None)
    assert hash_block(None, [1, 2], "s") != h0


def test_prefix_caching_disabled_never_hits() -> None:
    kv = make_kv_cache(enable_prefix_caching=False)
    a = seq("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    assert kv.computed_blocks(seq("b", list(range(9)))) == []
    kv.free("a")


def test_fork_shares_blocks_and_copy_on_write_on_partial_tail() -> None:
    kv = make_kv_cache()
    parent = seq("p", list(range(6)))  # blocks [0 full, 1 half]
    assert ids(kv.allocate_slots(parent, 6)) == [0, 1]
    parent.num_computed_tokens = 6
    parent.append_token(100)
    child = parent.fork("c")
    kv.fork(parent, child)
    assert kv.block_ids("c") == [0, 1] and kv.ref_counts("p") == [2, 2]
    # The parent writes position 6 into shared block 1: it gets a private copy (block 2).
    assert ids(kv.allocate_slots(parent, 1)) == [0, 2]
    assert kv.take_copies() == [(1, 2)]
    assert kv.ref_counts("p") == [2, 1] and kv.ref_counts("c") == [2, 1]
    # The child is now the only holder of block 1: it writes in place, no copy.
    child.replace_last_token(200)
    assert ids(kv.allocate_slots(child, 1)) == [0, 1]
    assert kv.take_copies() == []
    kv.free("p")
    kv.free("c")
    assert kv.stats().used == 0


def test_fork_on_block_boundary_needs_no_copy() -> None:
    kv = make_kv_cache()
    parent = seq("p", list(range(8)))
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    parent.append_token(1)
    child = parent.fork("c")
    kv.fork(parent, child)
    assert ids(kv.allocate_slots(parent, 1)) == [0, 1, 2]
    assert ids(kv.allocate_slots(child, 1)) == [0, 1, 3]
    assert kv.take_copies() == []
    assert kv.ref_counts("c") == [2, 2, 1]
    kv.free("p")
    kv.free("c")


def test_fork_errors() -> None:
    kv = make_kv_cache()
    with pytest.raises(ValueError, match="holds no device blocks"):
        kv.fork(seq("x", [1]), seq("y", [1]))


def test_swap_out_and_in_records_moves() -> None:
    kv = make_kv_cache(num_blocks=4, num_cpu_blocks=3)
    s = seq("a", list(range(6)))
    kv.allocate_slots(s, 6)
    s.num_computed_tokens = 6
    assert kv.can_swap_out("a")
    assert kv.swap_out("a") == [(0, 0), (1, 1)]
    assert kv.stats().used == 0 and kv.cpu_pool.stats().used == 2
    assert kv.cpu_block_ids("a") == [0, 1]
    # Another sequence takes device blocks 2 and 3 meanwhile.
    other = seq("b", list(range(100, 104)))
    assert ids(kv.allocate_slots(other, 4)) == [2]
    assert kv.swap_in("a") == [(0, 3), (1, 1)]
    assert kv.block_ids("a") == [3, 1]
    assert kv.cpu_pool.stats().used == 0
    kv.free("a")
    kv.free("b")


def test_swap_out_refused_when_cpu_pool_full() -> None:
    kv = make_kv_cache(num_blocks=4, num_cpu_blocks=1)
    s = seq("a", list(range(6)))
    kv.allocate_slots(s, 6)
    assert not kv.can_swap_out("a")
    with pytest.raises(ValueError, match="not enough free CPU blocks"):
        kv.swap_out("a")
    kv.free("a")


def test_free_in_swapped_state_releases_cpu_blocks() -> None:
    kv = make_kv_cache(num_blocks=4, num_cpu_blocks=4)
    s = seq("a", list(range(6)))
    kv.allocate_slots(s, 6)
    kv.swap_out("a")
    kv.free("a")
    assert kv.cpu_pool.stats().used == 0 and kv.stats().used == 0
