"""``quire-engine bench step`` in CI size, and the runner's vectorized step inputs checked
against the scheduler's own per-token slot mapping on a mixed prefill/decode batch."""

from __future__ import annotations

import json

import numpy as np

from quire_engine.cli import main
from quire_engine.core.sequence import FinishReason, Sequence
from quire_engine.model.runner import build_step_inputs
from tests.engine_tests.factories import make_scheduler


def test_step_bench_small(capsys: object) -> None:
    args = ["bench", "step", "--json", "--running", "1,3", "--steps", "4", "--prompt-len", "9"]
    assert main([*args, "--profile"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[attr-defined]
    assert out["steps"] == 4 and out["vocab_size"] == 320
    for count in ("1", "3"):
        result = out[count]
        assert result["step_us_p50"] > 0 and result["step_us_p99"] >= result["step_us_p50"]
        split = result["split_us_per_step"]
        assert {"schedule", "runner", "sample", "update", "detokenize", "other"} <= set(split)
    assert main([*args, "--metrics"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[attr-defined]
    assert out["3"]["metrics_us_p50"] > 0 and out["3"]["metrics_us_p99"] >= 0


def test_step_inputs_match_the_scheduler() -> None:
    sched = make_scheduler(32, max_num_seqs=4, max_num_batched_tokens=14, max_model_len=64)
    a = Sequence("a", list(range(10, 16)), max_tokens=8)  # 6 tokens
    b = Sequence("b", list(range(20, 33)), max_tokens=8)  # 13 tokens: chunked
    for s in (a, b):
        sched.add(s)
    first = sched.schedule()  # a: 6 tokens, b: the first 8 (budget 14)
    sched.update(first, {"a": 99})
    second = sched.schedule()  # a decodes 1 token, b prefills its last 5
    sched.update(second, {"a": 98, "b": 97})
    third = sched.schedule()  # pure decode: one token each
    for out in (first, second, third):
        x = build_step_inputs(out)
        assert x.slots.tolist() == out.slot_mapping()
        ids = [t for s, p, n in zip(out.seqs, out.start_positions, out.num_new_tokens, strict=True)
               for t in s.token_ids[p : p + n]]  # fmt: skip
        assert x.input_ids.tolist() == ids
        assert x.qsl.tolist() == list(np.cumsum([0, *out.num_new_tokens]))
        assert x.seq_lens.tolist() == [
            p + n for p, n in zip(out.start_positions, out.num_new_tokens, strict=True)
        ]
        tables = [t.tolist() for t in out.block_tables]
        width = max(len(t) for t in tables)
        assert x.tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert second.num_new_tokens == [1, 5] and build_step_inputs(second).sample_rows.tolist() == [
        0,
        5,
    ]
    assert build_step_inputs(second).positions.tolist() == [6, 8, 9, 10, 11, 12]
    assert build_step_inputs(third).positions.tolist() == [7, 13]
    assert build_step_inputs(third).input_ids.tolist() == [98, 97]
    for s in (a, b):
        sched.finish(s, FinishReason.ABORT)
