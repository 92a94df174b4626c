"""Property tests: random interleavings of add / step / fork / abort over a small pool.

After every operation: a block is in the free queue iff nobody references it, every ref count
equals the number of block tables holding that block, and the prefix cache maps each hash to a
block carrying that hash. After everything ends the pool is fully free.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quire_engine.core.block_pool import BlockPool
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.sequence import Sequence, SequenceStatus
from tests.engine_tests.factories import make_scheduler


def check_pool(pool: BlockPool, holders: Counter[int]) -> None:
    in_queue = pool.free_queue.block_ids()
    assert len(in_queue) == len(set(in_queue)) == pool.num_free
    queued = set(in_queue)
    for block in pool.blocks:
        assert (block.block_id in queued) == (block.ref_count == 0), block
        assert block.ref_count == holders[block.block_id], block
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    stats = pool.stats()
    assert stats.used + stats.free == stats.total
    assert stats.cached_free == sum(
        1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None
    )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.counter = 0

    @precondition(lambda self: self.sched is None)
    @rule(
        num_blocks=st.integers(8, 24),
        block_size=st.sampled_from([1, 2, 4]),
        mode=st.sampled_from(["recompute", "swap"]),
        prefix=st.booleans(),
        budget=st.integers(4, 32),
    )
    def build(self, num_blocks: int, block_size: int, mode: str, prefix: bool, budget: int) -> None:
        self.sched = make_scheduler(
            num_blocks,
            block_size,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            max_model_len=24,
            mode=mode,
            num_cpu_blocks=12,
            prefix=prefix,
        )

    @precondition(lambda self: self.sched is not None)
    @rule(
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12),
        max_tokens=st.integers(1, 8),
        salt=st.sampled_from([None, "t1"]),
    )
    def add(self, tokens: list[int], max_tokens: int, salt: str | None) -> None:
        assert self.sched is not None
        self.counter += 1
        seq = Sequence(f"s{self.counter}", tokens, max_tokens=max_tokens, cache_salt=salt)
        try:
            self.sched.add(seq)
        except ValueError:
            assert seq.seq_id not in self.sched.seqs

    @precondition(lambda self: self.sched is not None)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        assert self.sched is not None
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        sampled = {
            s.seq_id: data.draw(st.integers(0, 2))
            for s, smp in zip(out.seqs, out.samples, strict=True)
            if smp
        }
        self.sched.update(out, sampled)

    @precondition(lambda self: self.sched is not None and self.sched.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        assert self.sched is not None
        parent = data.draw(st.sampled_from(self.sched.running))
        if parent.num_computed_tokens == 0:
            return
        self.counter += 1
        self.sched.fork(parent, parent.fork(f"s{self.counter}"))

    @precondition(lambda self: self.sched is not None and self.sched.seqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.sched is not None
        seq_id = data.draw(st.sampled_from(sorted(self.sched.seqs)))
        self.sched.abort(seq_id)

    @invariant()
    def pool_consistent(self) -> None:
        if self.sched is None:
            return
        kv = self.sched.kv
        device: Counter[int] = Counter()
        cpu: Counter[int] = Counter()
        for seq in self.sched.seqs.values():
            device.update(kv.block_ids(seq.seq_id))
            cpu.update(kv.cpu_block_ids(seq.seq_id))
            if seq.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED):
                assert not kv.block_ids(seq.seq_id)
            if seq.status is not SequenceStatus.SWAPPED:
                assert not kv.cpu_block_ids(seq.seq_id)
        check_pool(kv.pool, device)
        check_pool(kv.cpu_pool, cpu)

    def teardown(self) -> None:
        if self.sched is None:
            return
        # Drain: everything must finish and give every block back.
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            out = self.sched.schedule()
            self.sched.update(
                out, {s.seq_id: 1 for s, smp in zip(out.seqs, out.samples, strict=True) if smp}
            )
        assert not self.sched.has_unfinished(), "scheduler stalled"
        assert self.sched.kv.stats().used == 0
        assert self.sched.kv.cpu_pool.stats().used == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerProperties = SchedulerMachine.TestCase
