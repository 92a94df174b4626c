"""One engine step batching different kinds of rows: a beam-search request and a seeded n=2
sampling request run together give exactly what each gives alone (seeded samples draw the same
tokens whatever they are batched with; beams are deterministic), so the step routes every
logits row to its own sample. A batch of plain greedy requests takes the step's own lane and
reports exactly what the general path reports, step by step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from quire_engine.core.outputs import RequestOutput
from quire_engine.core.request_table import RequestTable
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm import LLM
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.step_batch import GreedyBatch

PROMPT = [7, 42, 99, 3, 150, 11]
BEAM_PROMPT = [200, 5, 77, 18]  # another prompt: other logits in the same step
SAMPLED = SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=6, ignore_eos=True)
BEAM = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(engine: LLMEngine, requests: list[tuple[str, int | None]]) -> dict[str, RequestOutput]:
    for rid, beam_width in requests:
        if beam_width:
            engine.add_request(rid, BEAM_PROMPT, BEAM, beam_width=beam_width)
        else:
            engine.add_request(rid, PROMPT, SAMPLED)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _tokens(out: RequestOutput) -> list[Sequence[int]]:
    return [o.token_ids for o in out.outputs]


def test_beam_and_fan_out_in_one_step_match_each_alone() -> None:
    llm = LLM(num_blocks=64, max_model_len=256)
    engine = llm.engine
    together = _run(engine, [("beam", 2), ("sampled", None)])
    beam_alone = _run(engine, [("beam-alone", 2)])
    sampled_alone = _run(engine, [("sampled-alone", None)])
    assert _tokens(together["beam"]) == _tokens(beam_alone["beam-alone"])
    assert _tokens(together["sampled"]) == _tokens(sampled_alone["sampled-alone"])
    assert len(together["sampled"].outputs) == 2


def _summary(o: RequestOutput) -> tuple[Any, ...]:
    sample = o.outputs[0]
    tokens = list(sample.token_ids)
    return (o.request_id, tokens, sample.text, o.finished, sample.finish_reason,
            sample.stop_reason, o.error)  # fmt: skip


def _greedy_reports(engine: LLMEngine, stop_text: str, stop_id: int) -> list[list[tuple[Any, ...]]]:
    """Every step's reports for plain greedy requests that end every way a plain request can:
    max_tokens, max_model_len, a stop string (cut, or kept), a stop token id, EOS; one prompt is
    long enough to be prefilled in chunks while the others decode."""
    base = {"temperature": 0.0, "max_tokens": 12}
    requests: list[tuple[list[int], dict[str, Any]]] = [
        ([7, 42, 99], base),
        ([7, 42, 99], {**base, "stop": [stop_text]}),
        ([7, 42, 99], {**base, "stop": [stop_text], "include_stop_str_in_output": True}),
        ([7, 42, 99], {**base, "stop_token_ids": [stop_id]}),
        ([7, 42, 99], {**base, "max_tokens": 200}),  # runs into max_model_len
        ([5] * 40, {**base, "ignore_eos": True}),  # 40 tokens at a 16-token budget: chunked
    ]
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(**params))
    steps = []
    while engine.has_unfinished():
        steps.append([_summary(o) for o in engine.step()])
    return steps


def test_plain_greedy_lane_reports_what_the_general_path_reports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def engine() -> LLMEngine:  # a fresh one per run: no prefix-cache hits from the other run
        return LLM(num_blocks=64, max_model_len=48, max_num_batched_tokens=16).engine

    # A stop string and a stop token that the greedy run actually produces (tie-free: each is
    # taken from the run itself, not guessed).
    probe = SamplingParams(temperature=0.0, max_tokens=12)
    out = LLM(num_blocks=64, max_model_len=48).generate([[7, 42, 99]], probe)[0].outputs[0]
    assert len(out.token_ids) >= 6, "the probe must generate a few tokens"
    stop_id, stop_text = out.token_ids[4], out.text[2:4]
    lane_calls = 0
    lane = GreedyBatch.process

    def counted(*args: Any) -> list[RequestOutput]:
        nonlocal lane_calls
        lane_calls += 1
        return lane(*args)

    monkeypatch.setattr(GreedyBatch, "process", counted)
    in_lane = _greedy_reports(engine(), stop_text, stop_id)
    assert lane_calls == len(in_lane)  # every step took the lane
    monkeypatch.setattr(RequestTable, "all_plain_greedy", property(lambda self: False))
    general = _greedy_reports(engine(), stop_text, stop_id)
    assert lane_calls == len(in_lane)  # ... and none of these
    assert in_lane == general
    finals = {r[0]: r for step in in_lane for r in step if r[3]}
    assert [finals[f"r{i}"][4] for i in range(6)] == [
        "length", "stop", "stop", "stop", "length", "length"
    ]  # fmt: skip
    assert finals["r3"][5] == stop_id and finals["r1"][5] == stop_text
    assert stop_text not in finals["r1"][2] and finals["r2"][2].endswith(stop_text)
    assert len(finals["r4"][1]) == 48 - 3  # max_model_len
    # The chunked prompt is reported only once it samples, while the others decode.
    first_r5 = next(k for k, step in enumerate(in_lane) if any(r[0] == "r5" for r in step))
    assert first_r5 >= 2 and all(len(step) >= 1 for step in in_lane[:first_r5])
