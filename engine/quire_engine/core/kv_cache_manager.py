"""Per-sequence block tables over the block pool: on-demand growth, prefix reuse, fork, CoW, swap.

Ownership rules:

* The manager is the only holder that appears in ``BlockPool`` ref counts: each block id in a
  sequence's table is one reference, taken by ``allocate_slots``/``fork``/``swap_in`` and
  released by ``free``/``swap_out`` (deepest block first, so the deepest cached blocks are
  evicted first).
* A table only grows while its sequence is scheduled. Blocks holding a partially filled tail may be
  shared after ``fork``; the first holder that writes into such a block gets a private copy first
  (copy-on-write) and the (src, dst) pair is queued in ``pending_copies`` for the model runner,
  which must perform queued copies before the step's forward pass writes any K/V.
* A block is published to the prefix cache as soon as a scheduled step will fill it
  (``allocate_slots``), so requests admitted in the same step already share it: the runner writes
  every new token's K/V into the cache before any attention of that layer reads it. A block
  filled by a decode step (one new token) is the exception: it is published when its sequence
  lets go of its blocks (``free``: finish, abort, recompute preemption; ``swap_out``). Generated
  tokens reach other requests only after a client has seen them, so in practice such a block is
  looked up only after its sequence finished; hashing it at once would put hundreds of sha256
  calls into the step where equal-length sequences fill a block together (the scheduler's worst
  step) for no hit. Each block is still hashed exactly once.
* Swapped sequences hold blocks of the CPU pool only; ``swap_out``/``swap_in`` return (src, dst)
  moves that the runner performs before the forward pass (swap-outs first, then swap-ins, then CoW
  copies: a block freed by a swap-out may be reused in the same step).
* Sliding window (``CacheConfig.sliding_window``, set only when *every* layer of the model has
  one): ``release_out_of_window`` drops the reference on each leading block that no future query
  of the sequence can see, and puts ``RELEASED`` in its place. Tables stay positional (entry
  ``i`` covers positions ``i * block_size ..``); the attention reads only positions inside the
  window, so the placeholder's id is never read unmasked. A released block keeps its prefix hash
  in the free queue like any freed block. With a model that mixes local and global layers
  (Gemma 2/3) nothing is released: the global layers read every position.
* Host tier (``CacheConfig.num_host_blocks`` > 0, ``core/host_tier``): a cached block the device
  pool evicts is offered to the tier (``BlockPool``'s ``on_evict``). ``find_prefix`` continues a
  prompt's chain of device hits with the tier's; ``allocate_with_prefix`` takes the host hits
  into fresh device blocks, queues their loads and publishes them on the device at once (the
  runner performs the loads before the forward). ``take_host_moves`` hands a step's copies over.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Sequence_
from typing import NamedTuple

from quire_engine.core.block_pool import Block, BlockPool, PoolStats
from quire_engine.core.block_table import NEVER, RELEASED, BlockTable
from quire_engine.core.config import CacheConfig
from quire_engine.core.host_tier import HostMove, HostTier
from quire_engine.core.knobs import resolved
from quire_engine.core.lora import hash_extra
from quire_engine.core.sequence import Sequence


class PrefixHits(NamedTuple):
    """A prompt's cached prefix: its leading blocks found on the device (not yet held), then the
    hashes of the blocks after them found in the host tier, in prompt order."""

    device: list[Block]
    host: list[bytes]

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)


def hash_block(parent: bytes | None, token_ids: list[int], extra: str | None) -> bytes:
    """Prefix hash of one full block: chains the parent hash, the block's tokens and extra keys.

    sha256 rather than Python's ``hash`` so that two different prefixes never share K/V by a 64-bit
    collision. ``extra`` (a tenant's cache salt) is folded into the first block only; the chain
    carries it to every later block.
    """
    return hash_block_bytes(parent, memoryview(array("q", token_ids)).cast("B"), extra)


def hash_block_bytes(parent: bytes | None, token_bytes: memoryview, extra: str | None) -> bytes:
    """``hash_block`` over the block's token ids already laid out as int64 bytes: one sha256
    call, no per-token conversion."""
    data = (parent or b"") + token_bytes
    if extra is not None:
        data += b"\x00salt\x00" + extra.encode()
    return hashlib.sha256(data).digest()


def max_blocks_held(
    num_tokens: int, max_step_tokens: int, block_size: int, sliding_window: int | None
) -> int:
    """The most device blocks one sequence of up to ``num_tokens`` tokens holds at once when
    each step computes at most ``max_step_tokens`` of its tokens. Without a window: all of them.
    With one: before a step of ``n`` tokens at position ``c`` the table holds the blocks of
    positions ``c - window + 1 .. c - 1`` (the rest was released after earlier steps, and prefix
    hits before the window are never taken); the step adds those of ``c .. c + n - 1``."""
    full = -(-num_tokens // block_size)
    if sliding_window is None:
        return full
    span = min(max_step_tokens, num_tokens) + sliding_window - 1
    return min(full, -(-span // block_size) + 1)


class KVCacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.block_size = config.block_size
        self.sliding_window = config.sliding_window
        self.num_blocks = resolved(config.num_blocks, "num_blocks")  # the device pool's size
        # The host tier under the prefix cache (None without one): what the pool evicts goes there.
        self.host = HostTier(config.num_host_blocks) if config.num_host_blocks else None
        self.pool = BlockPool(
            self.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            on_evict=self.host.offload if self.host is not None else None,
        )
        self.cpu_pool = BlockPool(config.num_cpu_blocks, enable_prefix_caching=False)
        self._tables: dict[str, BlockTable] = {}
        self._cpu_tables: dict[str, list[Block]] = {}
        self.pending_copies: list[tuple[int, int]] = []
        # Sequences holding decode-filled blocks not yet published (see the module docstring).
        self._unpublished: dict[str, tuple[Sequence, BlockTable]] = {}
        # Counters in tokens, for quire_prefix_cache_queries_total / _hits_total.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_released = 0  # blocks released out of the window, over the manager's life

    # ---- queries -------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: str) -> list[int]:
        """A copy of a sequence's block ids, in table order."""
        table = self._tables.get(seq_id)
        return table.ids.tolist() if table is not None else []

    def live_ids(self, seq_id: str) -> array[int]:
        """The live id array of a sequence's table (what scheduler outputs carry); consumers
        read it and never mutate it."""
        table = self._tables.get(seq_id)
        return table.ids if table is not None else array("i")

    def ref_counts(self, seq_id: str) -> list[int]:
        """Per table entry (0 for a released one)."""
        table = self._tables.get(seq_id)
        return [b.ref_count for b in table.blocks] if table is not None else []

    def num_held(self, seq_id: str) -> int:
        """Device blocks the sequence holds a reference on (released ones excluded)."""
        table = self._tables.get(seq_id)
        return len(table.blocks) - table.num_released if table is not None else 0

    def cpu_block_ids(self, seq_id: str) -> list[int]:
        """Positional, like a device table: a released entry shows ``RELEASED``'s id."""
        return [b.block_id for b in self._cpu_tables.get(seq_id, [])]

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def reset_prefix_cache(self) -> bool:
        """``BlockPool.reset_prefix_cache`` of the device pool, then the host tier's (the CPU swap
        pool caches nothing)."""
        if not self.pool.reset_prefix_cache():
            return False
        return self.host is None or self.host.reset()

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the sequence's first ``num_blocks`` full blocks (computed lazily, cached on
        the sequence). Only blocks whose tokens are computed or being computed are asked for, and
        such tokens are final: a sampled token is replaced (a fork taking another candidate) only
        before it is first scheduled."""
        hashes = seq.block_hashes
        done = len(hashes)
        if done >= num_blocks:
            return hashes
        bs = self.block_size
        # The blocks' token ids as int64 machine words, converted in one call for all of them:
        # each block's bytes are then one slice, not a per-token conversion.
        words = array("q", seq.token_ids[done * bs : num_blocks * bs])
        data = memoryview(words).cast("B")  # [(num_blocks - done) * bs * 8] bytes
        step = bs * words.itemsize
        for i in range(done, num_blocks):
            parent = hashes[i - 1] if i else None
            salt = None if i else hash_extra(seq.cache_salt, seq.lora_id, seq.lora_path)
            k = i - done
            hashes.append(hash_block_bytes(parent, data[k * step : (k + 1) * step], salt))
        return hashes

    # ---- allocation ----------------------------------------------------------------------
    def computed_blocks(self, seq: Sequence) -> list[Block]:
        """Longest chain of cached full blocks matching the sequence's tokens (not yet held).

        At most ``num_tokens - 1`` tokens can hit: the last token is always recomputed because its
        logits are needed to sample. A sequence that wants prompt logprobs hits nothing.
        """
        if not self.pool.enable_prefix_caching or seq.prompt_logits:
            return []
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hits: list[Block] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def find_prefix(self, seq: Sequence) -> PrefixHits:
        """``computed_blocks``, then the host tier's hits for the blocks after them (the chain
        goes on while the tier holds the next block's hash)."""
        device = self.computed_blocks(seq)
        host: list[bytes] = []
        if self.host is not None and self.pool.enable_prefix_caching and not seq.prompt_logits:
            tier = self.host
            limit = (seq.num_tokens - 1) // self.block_size  # the hashes computed_blocks made
            for block_hash in seq.block_hashes[len(device) : limit]:
                if block_hash not in tier:
                    break
                host.append(block_hash)
        return PrefixHits(device, host)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> array[int] | None:
        """Make room for ``num_new_tokens`` tokens after ``seq.num_computed_tokens``.

        Returns the sequence's live block-id array, or None, changing nothing, when the pool
        cannot supply the blocks.
        """
        return self._allocate(seq, num_new_tokens, None)

    def allocate_with_prefix(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed: list[Block],
        host: Sequence_[bytes] = (),
    ) -> int | None:
        """Take ``computed`` (prefix-cache hits of a sequence that holds no blocks yet; ref + 1)
        and ``host`` (the host tier's hits after them: each into a fresh device block, its load
        queued) and make room for ``num_new_tokens`` tokens after them.

        Returns the number of tokens the hits cover, which becomes the sequence's
        ``num_computed_tokens`` (the scheduler owns that field and writes it), or None, changing
        nothing, when the pool cannot supply the blocks.
        """
        if self._allocate(seq, num_new_tokens, computed, host) is None:
            return None
        return (len(computed) + len(host)) * self.block_size

    def _allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed: list[Block] | None,
        host: Sequence_[bytes] = (),
    ) -> array[int] | None:
        table = self._tables.get(seq.seq_id)
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        if table is not None and end <= table.quiet_end and not computed:
            return table.ids  # the common decode step: the slots exist, nothing to do
        bs = self.block_size
        if table is not None:
            # Fast path: the slots exist and the tail block is private.
            if (
                end <= table.capacity
                and not computed
                and (
                    not table.forked or start % bs == 0 or table.blocks[start // bs].ref_count == 1
                )
            ):
                if end >= table.publish_at:  # this step fills a block: publish it
                    if num_new_tokens == 1 and self.pool.enable_prefix_caching:
                        self._unpublished[seq.seq_id] = (seq, table)
                        table.publish_at = NEVER  # queued once; _publish resets it
                        table.settle()
                    else:
                        self._publish(seq, table, end // bs)
                return table.ids
            if num_new_tokens == 1 and start == table.capacity and not computed:
                # Decode into a fresh block (every block_size steps per sequence): one private
                # block, nothing shared to copy, nothing full to publish.
                if not self.pool.num_free:
                    return None
                table.append(self.pool.allocate())
                return table.ids
            num_held = len(table.blocks)
        else:
            num_held = 0
        computed = computed or []
        num_hits = len(computed) + len(host)
        if num_hits and (num_held or start):
            raise ValueError("prefix hits can only be taken by a sequence holding no blocks")
        if num_hits:
            start = num_hits * bs
            end = start + num_new_tokens
        # Hits wholly before the window of the first new token are not taken at all.
        dead = self._num_dead(start) if num_hits else 0
        # Host hits at positions len(computed) .. num_hits - 1: a fresh block each unless dead.
        host_dead = min(max(dead - len(computed), 0), len(host))
        needed = self.num_blocks_for(end) - num_held - len(computed) - host_dead
        # Writing into a shared, partially filled block needs one private copy first.
        cow = (
            table is not None
            and start % bs != 0
            and start // bs < num_held
            and table.blocks[start // bs].ref_count > 1
        )
        revived = sum(1 for b in computed[dead:] if b.ref_count == 0)
        if max(needed, 0) + cow + revived > self.pool.num_free:
            return None

        if table is None:
            table = self._tables[seq.seq_id] = BlockTable(bs)
        if computed:
            for i, block in enumerate(computed):
                if i < dead:
                    table.append(RELEASED)
                    table.num_released += 1
                else:
                    self.pool.touch(block)
                    table.append(block)
        if host:
            self._load_host_hits(table, host, host_dead)
        if num_hits:
            table.set_cached(num_hits)
        if cow:
            i = start // bs
            shared = table.blocks[i]
            private = self.pool.allocate()
            table.blocks[i] = private
            table.ids[i] = private.block_id
            self.pool.free([shared])
            self.pending_copies.append((shared.block_id, private.block_id))
        for _ in range(needed - len(host) + host_dead):
            table.append(self.pool.allocate())
        if end >= table.publish_at:
            self._publish(seq, table, end // bs)
        return table.ids

    def _load_host_hits(self, table: BlockTable, host: Sequence_[bytes], num_dead: int) -> None:
        """Append the host hits to ``table`` (after its device hits): a dead one as ``RELEASED``,
        the others each in a fresh device block, its load queued and the block published at once
        (its K/V land before the step's forward reads anything)."""
        tier = self.host
        assert tier is not None  # host hits come from the tier
        for _ in range(num_dead):
            table.append(RELEASED)
            table.num_released += 1
        live = host[num_dead:]
        # Pinned first: allocating the destinations may offload evicted device blocks, and those
        # offloads must not take the host blocks about to be read.
        sources = tier.pin(live)
        for block_hash, src in zip(live, sources, strict=True):
            block = self.pool.allocate()
            tier.load(block_hash, src, block.block_id)
            self.pool.cache_block(block, block_hash)
            table.append(block)

    def note_prefix_query(
        self, num_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0
    ) -> None:
        """A prompt's first lookup: ``num_hit_tokens`` of its ``num_tokens`` found cached (on the
        device or in the host tier), ``num_host_hit_tokens`` of them in the tier, which was asked
        for every token the device did not have."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens
        if self.host is not None:
            device_hits = num_hit_tokens - num_host_hit_tokens
            self.host.note_query(num_tokens - device_hits, num_host_hit_tokens)

    def take_host_moves(self) -> tuple[list[HostMove], list[HostMove]]:
        """The step's host-tier copies, (offloads (device, host), loads (host, device)); empty
        without a tier. The scheduler calls it once per step, with ``take_copies``."""
        if self.host is None:
            return [], []
        return self.host.take_moves()

    def _publish_unpublished(self, seq_id: str) -> None:
        """Publish a sequence's decode-filled blocks before it lets go of them. Called between
        steps, so every token counted in ``num_computed_tokens`` is written."""
        entry = self._unpublished.pop(seq_id, None)
        if entry is not None:
            seq, table = entry
            self._publish(seq, table, seq.num_computed_tokens // self.block_size)

    def _publish(self, seq: Sequence, table: BlockTable, num_full: int) -> None:
        """Offer the sequence's first ``num_full`` (full) blocks to the prefix cache."""
        if num_full <= table.num_cached:
            return
        if self.pool.enable_prefix_caching:
            hashes = self.block_hashes(seq, num_full)
            for i in range(max(table.num_cached, table.num_released), num_full):
                self.pool.cache_block(table.blocks[i], hashes[i])
        table.set_cached(num_full)

    def _num_dead(self, position: int) -> int:
        """Leading blocks no query at ``position`` or later can see (it sees ``> p - window``)."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """See :func:`max_blocks_held`."""
        return max_blocks_held(num_tokens, max_step_tokens, self.block_size, self.sliding_window)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Drop the sequence's leading blocks that lie wholly before the window of its next
        query (position ``num_computed_tokens``, which sees positions ``> p - window``); returns
        how many were released. No-op without a sliding window. Call it after the sequence's
        progress advances: positions only grow, so a released block is never needed again."""
        table = self._tables.get(seq.seq_id)
        if self.sliding_window is None or table is None:
            return 0
        num = self._num_dead(seq.num_computed_tokens)
        if num <= table.num_released:
            return 0
        dropped = table.release_leading(min(num, len(table.blocks)))
        self.pool.free(reversed(dropped))
        self.num_released += len(dropped)
        return len(dropped)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (ref + 1 each); writes diverge by CoW."""
        if child.seq_id in self._tables or child.seq_id in self._cpu_tables:
            raise ValueError(f"sequence {child.seq_id!r} already holds blocks")
        src = self._tables.get(parent.seq_id)
        if src is None:
            raise ValueError(f"sequence {parent.seq_id!r} holds no device blocks to fork")
        table = self._tables[child.seq_id] = BlockTable(self.block_size)
        for block in src.blocks:
            if block is not RELEASED:
                self.pool.touch(block)
            table.append(block)
        table.num_released = src.num_released
        table.set_cached(src.num_cached)
        table.forked = src.forked = True  # writes into a shared tail block must copy first
        table.settle()
        src.settle()

    def free(self, seq_id: str) -> None:
        """Release everything the sequence holds, in any state (finish, abort, preemption)."""
        self._publish_unpublished(seq_id)
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self.pool.free(reversed(table.live()))
        cpu = self._cpu_tables.pop(seq_id, None)
        if cpu is not None:
            self.cpu_pool.free(reversed([b for b in cpu if b is not RELEASED]))

    # ---- swap ----------------------------------------------------------------------------
    def can_swap_out(self, seq_id: str) -> bool:
        table = self._tables.get(seq_id)
        return table is not None and len(table.live()) <= self.cpu_pool.num_free

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        """Move the sequence's blocks to the CPU pool; returns (device, cpu) copies. Released
        entries stay released (positional) in the CPU table and move nothing."""
        if not self.can_swap_out(seq_id):
            raise ValueError(f"cannot swap out {seq_id!r}: not enough free CPU blocks")
        self._publish_unpublished(seq_id)
        table = self._tables.pop(seq_id)
        live = table.live()
        cpu = [self.cpu_pool.allocate() for _ in live]
        self._cpu_tables[seq_id] = [RELEASED] * table.num_released + cpu
        # Shared blocks stay on the device for their other holders; ours become free (and stay
        # cached if full, so a later swap-in or request may still hit them).
        self.pool.free(reversed(live))
        return [(d.block_id, c.block_id) for d, c in zip(live, cpu, strict=True)]

    def can_swap_in(self, seq_id: str, extra_blocks: int = 0) -> bool:
        cpu = self._cpu_tables.get(seq_id)
        if cpu is None:
            return False
        held = sum(1 for b in cpu if b is not RELEASED)
        return held + extra_blocks <= self.pool.num_free

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks; returns (cpu, device) copies."""
        if not self.can_swap_in(seq_id):
            raise ValueError(f"cannot swap in {seq_id!r}: not enough free device blocks")
        cpu = self._cpu_tables.pop(seq_id)
        table = self._tables[seq_id] = BlockTable(self.block_size)
        moves = []
        for c in cpu:
            if c is RELEASED:
                table.append(RELEASED)
                table.num_released += 1
            else:
                table.append(self.pool.allocate())
                moves.append((c.block_id, table.blocks[-1].block_id))
        self.cpu_pool.free(reversed([b for b in cpu if b is not RELEASED]))
        return moves

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
