"""The host tier under the prefix cache: exact-state tests of the tier alone, of the KV cache
manager spilling evicted prefixes into it and taking them back, of the scheduler counting host
hits as cached tokens, and a state machine of the device pool and the tier together that also
simulates the runner's copies (every token a step reads as computed holds that token's K/V)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from quire_engine.core.config import CacheConfig
from quire_engine.core.host_tier import HostMove, HostTier
from quire_engine.core.scheduler import Scheduler, SchedulerOutput
from quire_engine.core.sequence import Sequence
from tests.engine_tests.core.test_block_properties import SchedulerMachine
from tests.engine_tests.factories import ids, make_kv_cache, make_scheduler

H = [bytes([i]) * 32 for i in range(16)]  # stand-in prefix hashes


def seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), max_tokens=4)


# ---- the tier alone -------------------------------------------------------------------------


def test_offload_fills_free_blocks_then_evicts_the_least_recently_used() -> None:
    tier = HostTier(2)
    assert tier.offload(H[0], 7) and tier.offload(H[1], 8)
    assert tier.take_moves() == ([HostMove(7, 0), HostMove(8, 1)], [])
    # A prefix already held is refreshed, not copied again: H[1] is now the oldest.
    assert not tier.offload(H[0], 9)
    assert tier.take_moves() == ([], [])
    assert tier.offload(H[2], 3)
    assert tier.take_moves() == ([HostMove(3, 1)], [])
    assert H[1] not in tier and tier.block_of(H[2]) == 1 and tier.block_of(H[0]) == 0
    assert tier.stats().dropped == 1 and tier.stats().offloaded == 3


def test_pinned_blocks_are_never_evicted_within_a_step() -> None:
    tier = HostTier(2)
    tier.offload(H[0], 0)
    tier.offload(H[1], 1)
    tier.take_moves()
    assert tier.pin([H[0]]) == [0]
    tier.load(H[0], 0, 5)
    # H[0] is a load source and H[2] takes H[1]'s block; H[3] finds only pinned blocks: dropped.
    assert tier.offload(H[2], 2)
    assert not tier.offload(H[3], 3)
    assert tier.pinned == {0, 1}
    offloads, loads = tier.take_moves()
    assert offloads == [HostMove(2, 1)] and loads == [HostMove(0, 5)]
    assert not tier.pinned and H[3] not in tier


def test_load_needs_a_pinned_holder_and_reset_waits_for_the_step() -> None:
    tier = HostTier(1)
    tier.offload(H[0], 4)
    assert not tier.reset()  # the offload is pending
    tier.take_moves()
    with pytest.raises(ValueError, match="not a pinned holder"):
        tier.load(H[0], 0, 1)  # not pinned this step
    assert tier.reset() and len(tier) == 0
    assert tier.offload(H[1], 2) and tier.block_of(H[1]) == 0
    tier.take_moves()


def test_an_empty_tier_keeps_nothing() -> None:
    tier = HostTier(0)
    assert not tier.offload(H[0], 1)
    assert tier.take_moves() == ([], []) and tier.stats().usage == 0.0


# ---- the KV cache manager ---------------------------------------------------------------------


def test_evicted_prefix_spills_and_comes_back_by_copy() -> None:
    kv = make_kv_cache(num_blocks=4, num_host_blocks=8)
    a = seq("a", list(range(9)))  # blocks 0, 1 full, block 2 holds token 8
    assert ids(kv.allocate_slots(a, 9)) == [0, 1, 2]
    a.num_computed_tokens = 9
    kv.free("a")
    b = seq("b", [50 + t for t in range(13)])  # 4 blocks: evicts 3, then 2, 1, 0
    assert ids(kv.allocate_slots(b, 13)) == [3, 2, 1, 0]
    offloads, loads = kv.take_host_moves()
    # Only the full, hashed blocks of a spill (block 2 held one token of a partial block).
    assert offloads == [HostMove(1, 0), HostMove(0, 1)] and loads == []
    b.num_computed_tokens = 13
    kv.free("b")
    again = seq("c", list(range(9)))
    hits = kv.find_prefix(again)
    assert hits.device == [] and hits.host == again.block_hashes[:2]
    assert kv.allocate_with_prefix(again, 1, hits.device, hits.host) == 8
    offloads, loads = kv.take_host_moves()
    # b freed its table deepest first, so the queue holds 0 (unhashed), 1, 2, 3 (its blocks
    # 2, 1, 0). The two loads take device 0 and 1 (a's blocks 0, 1 from host 1, 0), the
    # partial block takes 2; evicting b's blocks from device 1 and 2 spills them.
    assert ids(kv.live_ids("c")) == [0, 1, 2]
    assert loads == [HostMove(1, 0), HostMove(0, 1)]
    assert offloads == [HostMove(1, 2), HostMove(2, 3)]
    # Device 1 is read by an offload and written by a load in one step: the runner performs
    # offloads first. The loaded blocks are published on the device at once: a twin hits them.
    twin = seq("d", list(range(9)))
    assert [blk.block_id for blk in kv.find_prefix(twin).device] == [0, 1]
    kv.free("c")


def test_host_hits_continue_the_device_chain() -> None:
    kv = make_kv_cache(num_blocks=6, num_host_blocks=8)
    a = seq("a", list(range(13)))
    kv.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    kv.free("a")  # blocks 3, 2, 1, 0 queue in that order: block 3 (tokens 12) unhashed
    filler = seq("f", [90 + t for t in range(8)])
    kv.allocate_slots(filler, 8)  # takes 4 (free) and 5 (free), no eviction
    kv.free("f")
    other = seq("o", [70 + t for t in range(12)])
    kv.allocate_slots(other, 12)  # takes 3, 2, 1: evicts a's blocks 2 and 1 (hashed)
    kv.take_host_moves()
    probe = seq("p", list(range(13)))
    hits = kv.find_prefix(probe)
    assert [blk.block_id for blk in hits.device] == [0]
    assert hits.host == probe.block_hashes[1:3]
    kv.free("o")


def test_a_host_hit_is_pinned_before_its_destination_evicts_anything() -> None:
    # A tier of one block holding the prompt's hit; taking a device block for the load evicts a
    # cached device block, whose offload must not take the hit's host block: it is dropped.
    kv = make_kv_cache(num_blocks=3, num_host_blocks=1)
    a = seq("a", list(range(5)))  # one full block
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.free("a")
    b = seq("b", [40, 41, 42, 43, 44])
    kv.allocate_slots(b, 5)  # takes 2 and 1 (free, unhashed)
    b.num_computed_tokens = 5
    kv.free("b")  # b's full block 2 is cached; a's block 0 still too
    c = seq("c", [60] * 4)
    kv.allocate_slots(c, 4)  # evicts block 0 (a's prefix): spilled to host block 0
    assert kv.take_host_moves()[0] == [HostMove(0, 0)]
    kv.free("c")
    probe = seq("p", list(range(5)))
    hits = kv.find_prefix(probe)
    assert hits.host == probe.block_hashes[:1]
    assert kv.allocate_with_prefix(probe, 1, hits.device, hits.host) == 4
    offloads, loads = kv.take_host_moves()
    assert loads[0].src == 0 and HostMove(2, 0) not in offloads
    assert kv.host is not None and kv.host.block_of(probe.block_hashes[0]) == 0
    kv.free("p")


def test_no_tier_without_prefix_caching() -> None:
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        CacheConfig(num_blocks=4, enable_prefix_caching=False, kv_offloading_size=1.0)


# ---- the scheduler ------------------------------------------------------------------------------


def _run(sched: Scheduler, prompts: dict[str, list[int]]) -> list[SchedulerOutput]:
    for name, tokens in prompts.items():
        sched.add(Sequence(name, list(tokens), max_tokens=2))
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        outs.append(out)
        sched.update(
            out, {s.seq_id: 1 for s, smp in zip(out.seqs, out.samples, strict=True) if smp}
        )
    return outs


@pytest.mark.parametrize("num_host_blocks", [0, 32])
def test_the_issue_reproduction_in_miniature(num_host_blocks: int) -> None:
    """Prompts, then others that evict them, then the first again: cached only with a tier."""
    sched = make_scheduler(num_blocks=16, num_host_blocks=num_host_blocks)
    first = {f"a{i}": [i * 100 + t for t in range(20)] for i in range(3)}
    other = {f"b{i}": [i * 100 + 50 + t for t in range(20)] for i in range(3)}
    _run(sched, first)
    _run(sched, other)
    rerun = {f"again{i}": first[f"a{i}"] for i in range(3)}
    seqs = {}
    for name, tokens in rerun.items():
        seqs[name] = Sequence(name, list(tokens), max_tokens=2)
        sched.add(seqs[name])
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(
            out, {s.seq_id: 1 for s, smp in zip(out.seqs, out.samples, strict=True) if smp}
        )
    cached = [s.num_cached_tokens for s in seqs.values()]
    stats = sched.stats()
    if num_host_blocks:
        assert cached == [16, 16, 16]  # 4 of 5 blocks: the last token is always recomputed
        assert stats.host is not None and stats.host.hits == 48 and stats.host.loaded >= 12
        assert stats.prefix_hits >= 48
    else:
        assert cached == [0, 0, 0] and stats.host is None


# ---- the state machine ------------------------------------------------------------------------


def key(seq: Sequence, position: int) -> tuple[str | None, tuple[int, ...]]:
    """What a slot holds after it was written for ``seq``'s ``position``: the K/V of that token
    depend on the salt and every token up to it, so this stands for them."""
    return seq.cache_salt, tuple(seq.token_ids[: position + 1])


Slots = list[object]


class TierMachine(SchedulerMachine):
    """``SchedulerMachine`` (add, step, fork, abort over small pools, the pools' invariants) with
    a host tier and a model of the runner: every pool's slots hold ``key``s, the step's moves
    run in the runner's order, the forward writes its new tokens' keys, and every position a
    step reads as computed must hold the right key (a wrong copy, order or hash would show as a
    stale slot)."""

    def __init__(self) -> None:
        super().__init__()
        self.bs = 1
        self.device: list[Slots] = []
        self.cpu: list[Slots] = []
        self.host: list[Slots] = []

    @precondition(lambda self: self.sched is None)
    @rule(
        num_blocks=st.integers(8, 20),
        block_size=st.sampled_from([1, 2, 4]),
        mode=st.sampled_from(["recompute", "swap"]),
        num_host_blocks=st.integers(1, 12),
        budget=st.integers(4, 32),
    )
    def build(
        self, num_blocks: int, block_size: int, mode: str, num_host_blocks: int, budget: int
    ) -> None:
        self.sched = make_scheduler(
            num_blocks,
            block_size,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            max_model_len=24,
            mode=mode,
            num_cpu_blocks=12,
            num_host_blocks=num_host_blocks,
        )
        self.bs = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.cpu = [[None] * block_size for _ in range(12)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        sched = self.sched
        assert sched is not None
        out = sched.schedule()
        tier = sched.kv.host
        assert tier is not None and not tier.pinned  # the moves were handed over
        self._check_moves(out)
        self._run_moves(out)
        bs = self.bs
        batch = list(
            zip(out.seqs, out.start_positions, out.num_new_tokens, out.block_tables, strict=True)
        )
        for s, start, n, table in batch:  # the forward writes every new token's K/V first
            for p in range(start, start + n):
                self.device[table[p // bs]][p % bs] = key(s, p)
        for s, start, _, table in batch:  # then attention reads what is computed
            for p in range(start):
                assert self.device[table[p // bs]][p % bs] == key(s, p), (s.seq_id, p)
        sampled = {
            s.seq_id: data.draw(st.integers(0, 2))
            for s, smp in zip(out.seqs, out.samples, strict=True)
            if smp
        }
        sched.update(out, sampled)

    @precondition(lambda self: self.sched is not None)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.sched is not None
        self.sched.kv.reset_prefix_cache()

    def _check_moves(self, out: SchedulerOutput) -> None:
        """No block is written twice in a step. (A load may read a host block the same step
        offloads into: a prefix evicted and wanted again at once; the order makes it right.)"""
        for moves in (out.swap_out, out.swap_in, out.offload, out.load, out.block_copies):
            dst = [d for _, d in moves]
            assert len(dst) == len(set(dst)), moves
        written = [d for _, d in (*out.swap_in, *out.load, *out.block_copies)]
        assert len(written) == len(set(written))

    def _run_moves(self, out: SchedulerOutput) -> None:
        """The runner's order (``ModelRunner._move_blocks``): device reads, then writes."""
        for d, c in out.swap_out:
            self.cpu[c] = list(self.device[d])
        for d, h in out.offload:
            self.host[h] = list(self.device[d])
        for c, d in out.swap_in:
            self.device[d] = list(self.cpu[c])
        for h, d in out.load:
            self.device[d] = list(self.host[h])
        pending = [(d, list(self.device[s])) for s, d in out.block_copies]  # gather, scatter
        for d, slots in pending:
            self.device[d] = slots

    @invariant()
    def tier_consistent(self) -> None:
        if self.sched is None:
            return
        tier = self.sched.kv.host
        assert tier is not None
        held = [tier.block_of(h) for h in tier._lru]
        # One host block per prefix, within the capacity, disjoint from the free ones.
        assert len(held) == len(set(held)) <= tier.num_blocks
        assert all(b is not None and 0 <= b < tier.num_blocks for b in held)
        assert set(held).isdisjoint(tier._free)
        assert len(held) + len(tier._free) == tier.num_blocks
        stats = tier.stats()
        assert stats.used == len(held) and stats.hits <= stats.queries

    def teardown(self) -> None:
        super().teardown()  # drains: every device and swap block given back
        if self.sched is not None:
            assert self.sched.kv.host is not None and not self.sched.kv.host.pinned


TierMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHostTierProperties = TierMachine.TestCase
