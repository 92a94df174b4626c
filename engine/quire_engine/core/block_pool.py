"""The physical side of the paged KV cache: fixed blocks, a free queue and the prefix cache.

Ownership rules (the contract every caller keeps):

* All blocks exist from construction; nothing is reserved per request. A block is *used* while
  its ``ref_count`` > 0 and *free* while it is 0. A block is in the free queue **iff** its ref
  count is 0.
* Whoever puts a block id into a block table increments its ref count, through ``allocate`` (a
  fresh block, ref 1) or ``touch`` (a shared or revived cached block, ref + 1). The same holder
  releases it exactly once through ``free``. Nobody else changes ref counts.
* ``free`` does not forget a block's content: a full block keeps its prefix hash and, at ref 0,
  waits in the free queue where a later request can revive it (``touch``). Callers free a table's
  blocks deepest-first, so the deepest blocks of a prefix are evicted first.
* Eviction happens only in ``allocate``: it pops the least recently freed block from the queue's
  head and, if that block was cached, drops its hash, first telling ``on_evict`` (the host tier,
  ``core/host_tier``) which block and hash it drops. A block with ref > 0 is never evicted.
* Only a full block whose K/V have been written may be given a hash (``cache_block``); one hash maps
  to one block.

The pool is pure Python (no torch): the model runner owns the tensors the block ids index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Told (hash, block id) of each cached block ``allocate`` evicts, before its new holder writes it.
EvictHook = Callable[[bytes, int], object]


class Block:
    """One physical block. ``prev_free``/``next_free`` link it into the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"Block({self.block_id}, ref={self.ref_count}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append at the tail and removal
    from the middle (a cached block revived by a prefix hit leaves the queue wherever it sits)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        # Sentinels make every real block have both neighbours, so no branch on ends.
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        nxt = block.next_free  # unlinked inline: this runs once per block allocation
        assert nxt is not None  # a real block always has a successor (at least the sentinel)
        self._head.next_free = nxt
        nxt.prev_free = self._head
        block.prev_free = block.next_free = None
        self.num_free -= 1
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None  # the sentinel always has a predecessor
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def block_ids(self) -> list[int]:
        """Queue order, head (next to evict) first. O(n); for tests and debugging."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


@dataclass(frozen=True, slots=True)
class PoolStats:
    total: int
    used: int  # ref_count > 0
    cached_free: int  # ref_count == 0 but still holding a reusable prefix
    free: int  # ref_count == 0 (includes cached_free)

    @property
    def usage(self) -> float:
        return self.used / self.total


class BlockPool:
    """``num_blocks`` blocks with ref counts, a free queue and a hash -> block prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_prefix_caching: bool = True,
        on_evict: EvictHook | None = None,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}
        self._num_cached_free = 0
        self._on_evict = on_evict

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def allocate(self) -> Block:
        """A fresh private block (ref 1), evicting the least recently freed one if it was cached."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self._on_evict is not None:
                self._on_evict(block.block_hash, block.block_id)
            block.block_hash = None
            self._num_cached_free -= 1
        block.ref_count = 1
        return block

    def touch(self, block: Block) -> None:
        """Add a holder to an existing block (prefix hit or fork); revives a free cached block."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self._num_cached_free -= 1
        block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one holder from each block; blocks reaching ref 0 go to the queue's tail in the
        order given (callers pass a table deepest-first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        """Publish a full, written, held block under its prefix hash (first writer wins)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block.ref_count < 1:
            raise ValueError(f"block {block.block_id} must be held to be cached")
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): later requests recompute
        what they would have revived. Only while no block is held, since a held block's hash is
        its holder's to publish; returns whether the cache was reset. The free queue keeps its
        order: forgetting a hash changes which blocks are worth keeping, not which are free."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._num_cached_free = 0
        return True

    def stats(self) -> PoolStats:
        free = self.free_queue.num_free
        return PoolStats(
            total=self.num_blocks,
            used=self.num_blocks - free,
            cached_free=self._num_cached_free,
            free=free,
        )
