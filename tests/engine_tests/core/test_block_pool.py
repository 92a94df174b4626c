"""Exact-state tests of the block pool: free queue order, ref counts, prefix cache, eviction."""

from __future__ import annotations

import pytest

from quire_engine.core.block_pool import BlockPool, FreeBlockQueue, PoolStats


def test_free_queue_pop_remove_append_order() -> None:
    pool = BlockPool(5)
    q = pool.free_queue
    assert q.block_ids() == [0, 1, 2, 3, 4]
    b0 = pool.allocate()
    assert (b0.block_id, b0.ref_count) == (0, 1)
    # Removing from the middle is O(1) and keeps neighbours linked.
    q.remove(pool.blocks[2])
    assert q.block_ids() == [1, 3, 4]
    q.append(pool.blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]
    assert q.num_free == 4
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(b0)
    pool.free([b0])
    assert q.block_ids() == [1, 3, 4, 2, 0]


def test_empty_queue_pop_raises() -> None:
    q = FreeBlockQueue([])
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_ref_counts_and_double_free() -> None:
    pool = BlockPool(3)
    a = pool.allocate()
    pool.touch(a)
    assert a.ref_count == 2
    pool.free([a])
    assert a.ref_count == 1 and pool.num_free == 2
    pool.free([a])
    assert a.ref_count == 0 and pool.num_free == 3
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([a])


def test_cached_block_is_revived_then_evicted_lru() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    # Freed deepest-first: b is evicted before a.
    pool.free([c, b, a])
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert pool.stats() == PoolStats(total=4, used=0, cached_free=2, free=4)
    # A hit revives a cached block from the middle of the queue.
    hit = pool.lookup(b"ha")
    assert hit is a
    pool.touch(a)
    assert pool.free_queue.block_ids() == [3, 2, 1]
    assert pool.stats() == PoolStats(total=4, used=1, cached_free=1, free=3)
    # Allocation evicts from the head: 3, then 2 (uncached), then 1 (drops hash hb).
    got = [pool.allocate().block_id for _ in range(3)]
    assert got == [3, 2, 1]
    assert pool.lookup(b"hb") is None and b.block_hash is None
    assert pool.stats().cached_free == 0
    pool.free([pool.blocks[i] for i in (3, 2, 1, 0)])
    assert pool.stats().usage == 0.0


def test_cache_first_writer_wins_and_disabled_cache() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    assert pool.lookup(b"h") is a and b.block_hash is None
    pool.free([a, b])
    off = BlockPool(2, enable_prefix_caching=False)
    x = off.allocate()
    off.cache_block(x, b"h")
    assert off.lookup(b"h") is None and x.block_hash is None
    off.free([x])


def test_reset_prefix_cache_only_while_nothing_is_held() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free([b])
    # a is held: nothing is forgotten, not even b's free cached block.
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(b"hb") is b and a.block_hash == b"ha"
    assert pool.stats() == PoolStats(total=3, used=1, cached_free=1, free=2)
    pool.free([a])
    order = pool.free_queue.block_ids()
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(b"ha") is None and pool.lookup(b"hb") is None
    assert a.block_hash is None and b.block_hash is None
    assert pool.stats() == PoolStats(total=3, used=0, cached_free=0, free=3)
    assert pool.free_queue.block_ids() == order
    # The hashes are free to be published again.
    c = pool.allocate()
    pool.cache_block(c, b"ha")
    assert pool.lookup(b"ha") is c
    pool.free([c])


def test_cache_requires_held_block() -> None:
    pool = BlockPool(1)
    with pytest.raises(ValueError, match="must be held"):
        pool.cache_block(pool.blocks[0], b"h")


def test_usage_ratio() -> None:
    pool = BlockPool(4)
    held = [pool.allocate() for _ in range(3)]
    assert pool.stats().usage == 0.75
    pool.free(held)
