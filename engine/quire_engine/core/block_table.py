"""One sequence's block table, as the KV cache manager keeps it: the device blocks, their ids as
int32 machine words for the runner, and the counters that make a quiet decode step one
comparison. Owned by ``KVCacheManager`` (one per running sequence); nothing else mutates it.
"""

from __future__ import annotations

import sys
from array import array

from quire_engine.core.block_pool import Block

# The table entry of a released leading block: not a pool block (no pool ever counts or frees it).
# Its id 0 is a valid index for the attention kernels, which never read it unmasked.
RELEASED = Block(0)
# Block ids are C ints: 32 bits on every platform torch supports (the runner reads them as int32).
assert array("i").itemsize == 4, "array('i') must hold int32 block ids"
NEVER = sys.maxsize  # publish_at of a table whose full blocks are queued in _unpublished


class BlockTable:
    """One sequence's device blocks (``blocks``) and their ids (``ids``, shared read-only with
    scheduler outputs), plus how many leading blocks were already offered to the prefix cache.

    ``ids`` is an ``array('i')`` (int32 machine words) rather than a list: the runner builds the
    step's ``[num_seqs, max_blocks]`` block-table tensor by joining the tables' buffers
    (microseconds for hundreds of sequences) instead of converting every id of every table from a
    Python int each step, a cost that would grow with context length. Readers must not keep a
    buffer view of it (``memoryview``, ``np.frombuffer`` without a copy): an array whose buffer
    is exported cannot grow, and the table grows while its sequence runs.

    ``capacity`` (slots held), ``publish_at`` (the token count that fills the next unpublished
    block) and ``forked`` (whether any block may be shared with a sibling) are kept, and folded
    into ``quiet_end`` (the longest the sequence may grow to with nothing to allocate, copy or
    publish: 0 once forked, where a shared tail must be checked), so that the common decode
    step of ``allocate_slots`` is one comparison."""

    __slots__ = (
        "block_size", "blocks", "capacity", "forked", "ids", "num_cached", "num_released",
        "publish_at", "quiet_end",
    )  # fmt: skip

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[Block] = []
        self.ids: array[int] = array("i")
        self.capacity = 0
        self.forked = False
        self.num_released = 0  # leading entries that are RELEASED
        self.set_cached(0)

    def live(self) -> list[Block]:
        """The blocks this table holds a reference on, in table order."""
        return self.blocks[self.num_released :]

    def release_leading(self, num: int) -> list[Block]:
        """Replace entries ``num_released .. num - 1`` by ``RELEASED``; returns the blocks
        whose reference the caller must drop."""
        dropped = self.blocks[self.num_released : num]
        for i in range(self.num_released, num):
            self.blocks[i] = RELEASED
            self.ids[i] = RELEASED.block_id
        self.num_released = max(self.num_released, num)
        return dropped

    def append(self, block: Block) -> None:
        self.blocks.append(block)
        self.ids.append(block.block_id)
        self.capacity += self.block_size
        self.settle()

    def set_cached(self, num_cached: int) -> None:
        self.num_cached = num_cached
        self.publish_at = (num_cached + 1) * self.block_size
        self.settle()

    def settle(self) -> None:
        """Recompute ``quiet_end``; called whenever capacity, publish_at or forked change."""
        self.quiet_end = 0 if self.forked else min(self.capacity, self.publish_at - 1)
