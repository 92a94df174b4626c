"""The host tier under the prefix cache: full, hashed blocks the device pool evicts are kept in
host memory under their prefix hash, and a prompt whose prefix misses on the device but hits here
gets them copied back instead of recomputed (``--kv-offloading-size``).

Ownership rules (the contract every caller keeps):

* The tier owns host block ids ``0 .. num_blocks - 1``, the hash -> host block map (in LRU
  order: least recently offloaded or hit first) and the step's pending moves. No table holds a
  host block: an entry lives until the LRU evicts it for a newer one (or ``reset``). So the tier
  is an exclusive cache of *content*, with no ref counts to leak.
* ``offload`` is called by the device pool (``BlockPool``'s ``on_evict``) when it evicts a cached
  block: the block is full and its K/V were written by an earlier step (only such a block has a
  hash when it can be evicted), and the step that reuses it will overwrite it. The runner performs
  offloads before anything of the step writes a device block.
* ``pin`` + ``load`` queue a host hit's copy into a freshly allocated device block; the runner
  performs loads after offloads and before the forward, so the prefill that follows reads them.
* A host block read (a load's source) or written (an offload's destination) by the step being
  planned is *pinned*: it cannot be evicted until ``take_moves`` hands the step's moves over (the
  end of ``Scheduler.schedule``). So one step's copies never write a host block twice, and never
  overwrite one a load reads. A load may read a block the same step offloads into (a prefix
  evicted and wanted again within one step): the runner performs offloads first.

Pure Python (no torch): the model runner owns the host tensors the ids index (``model/host_pool``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


class HostMove(NamedTuple):
    """One block copy between the device pool and the host tier: ``src`` to ``dst`` (device to
    host for an offload, host to device for a load)."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """A snapshot for the metrics. Counters are cumulative since the tier was made."""

    capacity: int  # host blocks
    used: int  # host blocks holding a prefix
    queries: int  # prompt tokens looked up here after the device missed (first schedule only)
    hits: int  # of those, found here (and copied back)
    offloaded: int  # blocks copied device -> host
    loaded: int  # blocks copied host -> device
    dropped: int  # prefixes the LRU dropped to make room

    @property
    def usage(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


class HostTier:
    """``num_blocks`` host blocks keyed by prefix hash, LRU, with the step's pending copies."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0; got {num_blocks}")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, oldest first
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ... first
        self._pinned: set[int] = set()
        self._offloads: list[HostMove] = []  # (device, host)
        self._loads: list[HostMove] = []  # (host, device)
        self.queries = self.hits = 0  # tokens
        self.offloaded = self.loaded = self.dropped = 0  # blocks

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def block_of(self, block_hash: bytes) -> int | None:
        """The host block holding ``block_hash`` (None: not here). Changes nothing."""
        return self._lru.get(block_hash)

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pinned)

    def offload(self, block_hash: bytes, device_block: int) -> bool:
        """Keep the prefix of evicted ``device_block`` under ``block_hash``; returns whether a
        copy was queued. A prefix already here is only refreshed (the bytes are the same: one
        hash, one content); with no free or evictable host block the prefix is dropped."""
        host = self._lru.get(block_hash)
        if host is not None:
            self._lru.move_to_end(block_hash)
            return False
        host = self._take_block()
        if host is None:
            return False
        self._lru[block_hash] = host
        self._pinned.add(host)
        self._offloads.append(HostMove(device_block, host))
        self.offloaded += 1
        return True

    def pin(self, hashes: Iterable[bytes]) -> list[int]:
        """Pin the host blocks of ``hashes`` (each must be here) for this step, so that offloads
        queued while their device destinations are allocated cannot evict them; their blocks."""
        blocks = [self._lru[h] for h in hashes]
        self._pinned.update(blocks)
        return blocks

    def load(self, block_hash: bytes, host_block: int, device_block: int) -> None:
        """Queue the copy of pinned ``host_block`` (holding ``block_hash``) into ``device_block``;
        the prefix stays here too (refreshed in the LRU)."""
        if self._lru.get(block_hash) != host_block or host_block not in self._pinned:
            raise ValueError(f"host block {host_block} is not a pinned holder of that prefix")
        self._lru.move_to_end(block_hash)
        self._loads.append(HostMove(host_block, device_block))
        self.loaded += 1

    def note_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def take_moves(self) -> tuple[list[HostMove], list[HostMove]]:
        """The step's (offloads, loads), handed to the runner once; unpins everything."""
        moves = self._offloads, self._loads
        self._offloads, self._loads = [], []
        self._pinned.clear()
        return moves

    def reset(self) -> bool:
        """Forget every prefix (``reset_prefix_cache``); refused (False) while a step's moves are
        pending. A copy still in flight into a forgotten block is harmless: the block is free, and
        a later offload into it is ordered after it."""
        if self._pinned:
            return False
        self._lru.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        return True

    def stats(self) -> HostTierStats:
        return HostTierStats(
            self.num_blocks,
            len(self._lru),
            self.queries,
            self.hits,
            self.offloaded,
            self.loaded,
            self.dropped,
        )

    def _take_block(self) -> int | None:
        """A free host block, else the least recently used unpinned one (its prefix dropped)."""
        if self._free:
            return self._free.pop()
        for block_hash, host in self._lru.items():  # pinned ones are few: a short walk
            if host not in self._pinned:
                del self._lru[block_hash]
                self.dropped += 1
                return host
        return None
