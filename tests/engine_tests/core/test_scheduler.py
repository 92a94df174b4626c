"""Scheduler tests: token budget, chunked prefill, prefix hits, preemption in both modes, abort,
rejection. A fake model appends deterministic tokens so outcomes are exact."""

from __future__ import annotations

import pytest

from quire_engine.core.config import PreemptionMode
from quire_engine.core.scheduler import Scheduler, SchedulerOutput
from quire_engine.core.sequence import FinishReason, Sequence, SequenceStatus
from tests.engine_tests.factories import make_scheduler


def fake_token(seq: Sequence) -> int:
    # Depends only on the sequence's own history: any schedule must give the same outputs.
    return (sum(seq.token_ids) * 31 + len(seq.token_ids)) % 1000


def run_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(
        out, {s.seq_id: fake_token(s) for s, smp in zip(out.seqs, out.samples, strict=True) if smp}
    )
    return out


def run_all(sched: Scheduler, limit: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(run_step(sched))
        assert len(outs) < limit, "scheduler made no progress"
    return outs


def test_budget_and_max_num_seqs_respected() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=10)
    for i in range(3):
        sched.add(Sequence(f"s{i}", [i] * 6, max_tokens=3))
    out = sched.schedule()
    # s0 takes 6 tokens, s1 the remaining 4 (chunked), s2 waits (budget and seq cap).
    assert [s.seq_id for s in out.seqs] == ["s0", "s1"]
    assert out.num_new_tokens == [6, 4] and out.start_positions == [0, 0]
    assert out.samples == [True, False]
    assert out.num_batched_tokens == 10
    assert [s.seq_id for s in sched.waiting] == ["s2"]
    sched.update(out, {"s0": 7})
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)] == [
        ("s0", 1),
        ("s1", 2),
    ]
    assert out.start_positions == [6, 4]
    assert out.samples == [True, True]
    sched.update(out, {"s0": 1, "s1": 2})
    run_all(sched)


def test_chunked_prefill_slot_mapping_and_tables() -> None:
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add(Sequence("a", list(range(11)), max_tokens=2))
    steps = []
    while sched.has_unfinished():
        out = run_step(sched)
        steps.append((out.num_new_tokens[0], out.start_positions[0], out.slot_mapping()))
    assert steps == [
        (5, 0, [0, 1, 2, 3, 4]),
        (5, 5, [5, 6, 7, 8, 9]),
        (1, 10, [10]),  # last prompt token: logits sampled here
        (1, 11, [11]),  # first decode step
    ]


def test_prefix_hit_skips_cached_tokens_and_counts_tokens() -> None:
    sched = make_scheduler()
    system = list(range(100, 112))  # 3 full blocks of 4
    sched.add(Sequence("a", [*system, 1, 2], max_tokens=1))
    run_all(sched)
    sched.add(Sequence("b", [*system, 3], max_tokens=1))
    out = sched.schedule()
    assert out.start_positions == [12] and out.num_new_tokens == [1]
    assert sched.kv.prefix_hits == 12 and sched.kv.prefix_queries == 14 + 13
    sched.update(out, {"b": 5})
    assert not sched.has_unfinished()


def test_full_prompt_hit_still_recomputes_last_token() -> None:
    sched = make_scheduler()
    sched.add(Sequence("a", list(range(8)), max_tokens=1))
    run_all(sched)
    sched.add(Sequence("b", list(range(8)), max_tokens=1))
    out = sched.schedule()
    # 8 tokens = 2 full cached blocks, but only 7 may hit: block 0 reused, 4 tokens recomputed.
    assert out.start_positions == [4] and out.num_new_tokens == [4]
    run_all(sched)


def outputs_without_pressure(prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    sched = make_scheduler(num_blocks=256, max_num_seqs=16)
    seqs = [Sequence(f"s{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    run_all(sched)
    return {s.seq_id: s.output_token_ids for s in seqs}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tiny_pool_all_finish_with_same_outputs(mode: str) -> None:
    prompts = [[i + 1] * (5 + 3 * i) for i in range(6)]
    expected = outputs_without_pressure(prompts, max_tokens=20)
    # 12 blocks of 4 = 48 slots for 6 sequences that grow to 25..40 tokens.
    sched = make_scheduler(num_blocks=12, mode=mode, num_cpu_blocks=64)
    seqs = [Sequence(f"s{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    outs = run_all(sched)
    preempted = sum(len(o.preempted) for o in outs)
    assert preempted > 0
    assert sched.num_preemptions[PreemptionMode(mode)] > 0
    if mode == "swap":
        assert any(o.swap_out for o in outs) and any(o.swap_in for o in outs)
        assert sum(len(o.swap_out) for o in outs) == sum(len(o.swap_in) for o in outs)
    assert {s.seq_id: s.output_token_ids for s in seqs} == expected
    assert all(s.finish_reason == "length" for s in seqs)
    assert sched.kv.stats().used == 0 and sched.kv.cpu_pool.stats().used == 0


def test_preemption_victim_is_newest_and_oldest_progresses() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a = Sequence("a", [1] * 8, max_tokens=12)  # grows to 20 tokens = 5 blocks
    b = Sequence("b", [2] * 8, max_tokens=12)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq_id for s in out.seqs] == ["a", "b"]
    first_preempt = None
    progress_a = []
    while sched.has_unfinished():
        out = run_step(sched)
        progress_a.append(a.num_computed_tokens)
        if out.preempted and first_preempt is None:
            first_preempt = [s.seq_id for s in out.preempted]
            assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert first_preempt == ["b"]
    assert progress_a == sorted(progress_a)  # the oldest never went backwards
    assert a.finish_reason == b.finish_reason == "length"


def test_only_the_first_schedule_is_a_prefix_lookup() -> None:
    # A recompute victim finds its own blocks again when it is rescheduled: counting that as a
    # hit would inflate the hit rate exactly when the server is overloaded (vLLM leaves it out).
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a = Sequence("a", [1] * 8, max_tokens=12)
    b = Sequence("b", [2] * 8, max_tokens=12)
    sched.add(a)
    sched.add(b)
    assert a.num_cached_tokens == b.num_cached_tokens == -1  # not scheduled yet
    outs = run_all(sched)
    assert [s.seq_id for o in outs for s in o.preempted] == ["b"]
    assert sched.kv.prefix_queries == 8 + 8 and sched.kv.prefix_hits == 0
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert b.fork("b/1").num_cached_tokens == 0  # a fork never looks up


def test_swap_falls_back_to_recompute_without_cpu_space() -> None:
    sched = make_scheduler(num_blocks=6, mode="swap", num_cpu_blocks=0)
    for name in "ab":
        sched.add(Sequence(name, [3] * 8, max_tokens=12))
    run_all(sched)
    assert sched.num_preemptions[PreemptionMode.RECOMPUTE] > 0
    assert sched.num_preemptions[PreemptionMode.SWAP] == 0


def test_abort_in_every_state_frees_everything() -> None:
    sched = make_scheduler(num_blocks=6, mode="swap", num_cpu_blocks=16, max_num_batched_tokens=64)
    a = Sequence("a", [1] * 8, max_tokens=12)
    b = Sequence("b", [2] * 8, max_tokens=12)
    for s in (a, b):
        sched.add(s)
    while b.status is not SequenceStatus.SWAPPED:
        run_step(sched)
    c = Sequence("c", [3] * 4, max_tokens=4)
    sched.add(c)
    run_step(sched)  # swapped work is pending, so new requests wait
    assert (a.status, b.status, c.status) == (
        SequenceStatus.RUNNING,
        SequenceStatus.SWAPPED,
        SequenceStatus.WAITING,
    )
    assert sched.kv.stats().used > 0 and sched.kv.cpu_pool.stats().used > 0
    for s in (b, c, a):
        assert sched.abort(s.seq_id) is s
        assert s.finish_reason == "abort" and s.is_finished
    assert sched.abort("a") is None  # idempotent
    assert not sched.has_unfinished()
    assert sched.kv.stats().used == 0 and sched.kv.cpu_pool.stats().used == 0


def test_abort_waiting_and_mid_step() -> None:
    sched = make_scheduler()
    sched.add(Sequence("w", [1, 2, 3], max_tokens=2))
    sched.add(Sequence("r", [4, 5, 6], max_tokens=2))
    out = sched.schedule()
    sched.abort("r")  # aborted while its step is in flight
    sched.update(out, {"w": 1, "r": 2})
    assert sched.seqs.keys() == {"w"}
    sched.abort("w")
    assert sched.kv.stats().used == 0


def test_oversize_request_rejected_with_numbers() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"needs up to 5 KV blocks .* num_blocks=4"):
        sched.add(Sequence("big", [1] * 10, max_tokens=10))
    with pytest.raises(ValueError, match="prompt has 65 tokens, more than max_model_len=64"):
        sched.add(Sequence("long", [1] * 65, max_tokens=1))
    assert not sched.has_unfinished()


def test_finish_at_max_model_len() -> None:
    sched = make_scheduler(max_model_len=10)
    s = Sequence("a", [1] * 8, max_tokens=100)
    sched.add(s)
    run_all(sched)
    assert len(s.token_ids) == 10 and s.finish_reason == "length"


def test_advance_takes_tokens_aligned_with_the_batch() -> None:
    sched = make_scheduler(max_num_batched_tokens=6, max_model_len=9)
    a = Sequence("a", [1, 2, 3], max_tokens=100)  # capped by max_model_len: 6 tokens to go
    b = Sequence("b", [4] * 5, max_tokens=2)  # prefilled in two chunks (3 + 2)
    sched.add(a)
    sched.add(b)
    assert (a.token_limit, b.token_limit) == (9, 7)  # min(prompt + max_tokens, max_model_len)
    out = sched.schedule()
    assert out.num_new_tokens == [3, 3] and out.samples == [True, False]
    assert sched.advance(out, [10, None]) == []  # b only computed a chunk: nothing appended
    assert a.output_token_ids == [10] and not b.output_token_ids
    assert (a.num_computed_tokens, b.num_computed_tokens) == (3, 3)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 2] and out.samples == [True, True]
    sched.advance(out, [11, 20])
    out = sched.schedule()
    assert sched.advance(out, [12, 21]) == [b]  # its second token: max_tokens
    assert b.finish_reason == "length" and b.token_ids == [4] * 5 + [20, 21]
    while sched.has_unfinished():
        out = sched.schedule()
        sched.advance(out, [13])
    assert len(a.token_ids) == 9 and a.finish_reason == "length"
    with pytest.raises(ValueError, match="zip"):
        sched.advance(out, [1, 2])  # one token per scheduled sequence, no more


def test_fork_children_share_prompt_blocks() -> None:
    sched = make_scheduler()
    parent = Sequence("p", list(range(6)), max_tokens=4)
    sched.add(parent)
    out = sched.schedule()
    sched.update(out, {"p": 50})
    for j in (1, 2, 3):
        child = parent.fork(f"p.{j}")
        child.replace_last_token(50 + j)
        sched.fork(parent, child)
    assert sched.kv.stats().used == 2  # 4 sequences, 2 shared blocks
    out = sched.schedule()
    # Each writer into the shared half block but the last gets a private copy.
    assert len(out.block_copies) == 3
    assert all(src == 1 for src, _ in out.block_copies)
    sched.update(out, {s.seq_id: 7 for s in out.seqs})
    assert sched.kv.stats().used == 5
    run_all(sched)


def test_fork_of_waiting_parent_waits_too() -> None:
    sched = make_scheduler()
    parent = Sequence("p", [1, 2, 3], max_tokens=2)
    sched.add(parent)
    child = parent.fork("c")
    sched.fork(parent, child)
    assert child.status is SequenceStatus.WAITING and sched.waiting[0] is child
    assert sched.kv.block_ids("c") == []
    run_all(sched)
    assert child.finish_reason == parent.finish_reason == "length"


def test_duplicate_ids_and_bad_fork_rejected() -> None:
    sched = make_scheduler()
    s = Sequence("a", [1], max_tokens=1)
    sched.add(s)
    with pytest.raises(ValueError, match="duplicate sequence id"):
        sched.add(Sequence("a", [1], max_tokens=1))
    run_all(sched)
    with pytest.raises(ValueError, match="can only fork an unfinished sequence"):
        sched.fork(s, s.fork("b"))


def test_decode_filled_blocks_are_published_when_the_sequence_lets_go() -> None:
    """Prompt blocks are hashed when scheduled; blocks that decode steps fill are hashed when the
    sequence frees them (finish here), so a later prompt with the same text still hits them."""
    sched = make_scheduler(block_size=4)
    a = Sequence("a", [1, 2, 3, 4, 5, 6], max_tokens=4)
    sched.add(a)
    run_step(sched)  # prefill: block 0 (tokens 1-4) is full and published, block 1 half full
    assert [b.block_hash is not None for b in sched.kv.pool.blocks[:2]] == [True, False]
    run_step(sched)  # decode writes position 6
    run_step(sched)  # decode writes position 7: block 1 is full, its hash waits
    assert sched.kv.block_ids("a") == [0, 1]
    assert sched.kv.pool.blocks[1].block_hash is None
    full = list(a.token_ids[:8])
    probe = Sequence("probe", [*full, 0], max_tokens=1)
    assert [b.block_id for b in sched.kv.computed_blocks(probe)] == [0]
    run_all(sched)  # a finishes (max_tokens): its blocks are freed, the full ones published
    assert a.is_finished and sched.kv.stats().used == 0
    later = Sequence("later", [*full, 0], max_tokens=1)
    assert [b.block_id for b in sched.kv.computed_blocks(later)] == [0, 1]


def test_decode_into_fresh_block_takes_the_queue_head() -> None:
    sched = make_scheduler(num_blocks=8, block_size=2)
    a = Sequence("a", [1, 2], max_tokens=4)
    sched.add(a)
    run_step(sched)  # prefill fills block 0
    out = run_step(sched)  # position 2 needs a fresh block: the free queue's head, block 1
    assert [t.tolist() for t in out.block_tables] == [[0, 1]] and out.start_positions == [2]
    assert sched.kv.ref_counts("a") == [1, 1]
    sched.finish(a, FinishReason.ABORT)
    assert sched.kv.stats().used == 0
