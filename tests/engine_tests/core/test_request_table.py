"""The request table against a real scheduler: membership changes keep the table and the
scheduler in step, with exact block counts (no model, no tokenizer needed)."""

from __future__ import annotations

import pytest

from quire_engine.core.request_table import Request, RequestTable
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.sequence import Sequence, SequenceStatus
from tests.engine_tests.factories import make_scheduler


def make_table(num_blocks: int = 8) -> RequestTable:
    scheduler = make_scheduler(num_blocks, max_num_seqs=4, max_model_len=64)
    return RequestTable(scheduler, tokenizer=None)


def add(table: RequestTable, rid: str, prompt: list[int], **params: object) -> Request:
    req = Request(rid, None, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    seq = Sequence(f"{rid}/0", prompt, max_tokens=req.params.max_tokens)
    table.add(req, table.new_sample(req, seq, 0, None))
    return req


def test_add_is_all_or_nothing() -> None:
    table = make_table(num_blocks=2)  # 8 slots
    add(table, "a", [1, 2, 3], max_tokens=2)
    assert table.ids() == ["a"] and list(table.scheduler.seqs) == ["a/0"]
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        add(table, "a", [1])
    with pytest.raises(ValueError, match="needs up to 3 KV blocks"):
        add(table, "b", [1] * 9, max_tokens=2)  # the scheduler refuses: nothing inserted
    assert table.ids() == ["a"] and list(table.scheduler.seqs) == ["a/0"]
    assert table.owner("a/0")[0].request_id == "a"
    with pytest.raises(KeyError):
        table.owner("b/0")


def test_fork_retire_fail_and_remove_return_every_block() -> None:
    table = make_table()
    sched = table.scheduler
    req = add(table, "r", [1, 2, 3, 4, 5], n=2, max_tokens=4)
    out = sched.schedule()  # prefill: 2 blocks of 4
    sched.update(out, {"r/0": 9})
    first = req.samples[0]
    child = table.fork(req, first, "r/1", 1, None, last_token=7)
    assert child.seq.output_token_ids == [7] and first.seq.output_token_ids == [9]
    assert table.owner("r/1") == (req, child)
    assert sched.kv.stats().used == 2  # shared, not copied
    table.retire(req, child)
    assert [s.seq.seq_id for s in req.samples] == ["r/0"] and "r/1" not in sched.seqs
    table.fail(req, "boom")
    assert req.finished and req.error == "boom"
    assert first.finish_reason == "abort" and first.seq.status is SequenceStatus.FINISHED
    assert sched.kv.stats().used == 0 and "r" in table  # listed until the engine reports it
    table.fail(req, "second error")
    assert req.error == "boom"  # the first error is kept
    table.remove(req)
    assert len(table) == 0 and not sched.seqs


def test_plain_greedy_requests_are_counted_through_every_exit() -> None:
    table = make_table()
    assert table.all_plain_greedy  # vacuously: no request
    plain = add(table, "plain", [1, 2], temperature=0.0, max_tokens=2)
    assert plain.plain_greedy and table.all_plain_greedy
    sampled = add(table, "sampled", [3], temperature=0.8, max_tokens=2)
    fanned = add(table, "fanned", [4], temperature=0.0, n=2, max_tokens=2)
    with_logprobs = add(table, "lp", [5], temperature=0.0, logprobs=1, max_tokens=2)
    assert not any(r.plain_greedy for r in (sampled, fanned, with_logprobs))
    assert fanned.single is False and with_logprobs.single is True
    with pytest.raises(ValueError, match="duplicate"):
        add(table, "sampled", [3], temperature=0.8)  # a rejected add counts nothing
    table.abort("sampled")
    table.abort("sampled")  # unknown now: ignored, counted once
    assert not table.all_plain_greedy
    table.fail(fanned, "boom")  # failed but listed until reported
    assert not table.all_plain_greedy
    table.remove(fanned)
    table.remove(fanned)
    table.abort("lp")
    assert table.all_plain_greedy
    table.abort("plain")
    assert table.all_plain_greedy and len(table) == 0


def test_abort_in_any_state() -> None:
    table = make_table()
    running = add(table, "r", [3, 4, 5])
    table.scheduler.schedule()
    waiting = add(table, "w", [1, 2])
    assert running.samples[0].seq.status is SequenceStatus.RUNNING
    assert waiting.samples[0].seq.status is SequenceStatus.WAITING
    assert table.abort("r") is running and table.abort("w") is waiting
    assert table.abort("unknown") is None
    assert len(table) == 0 and table.scheduler.kv.stats().used == 0
    assert all(s.finish_reason == "abort" for s in running.samples + waiting.samples)
