"""One engine step batching different kinds of rows: a beam-search request and a seeded n=2
sampling request run together give exactly what each gives alone (seeded samples draw the same
tokens whatever they are batched with; beams are deterministic), so the step routes every
logits row to its own sample."""

from __future__ import annotations

from quire_engine.engine import LLMEngine
from quire_engine.llm import LLM
from quire_engine.outputs import RequestOutput
from quire_engine.sampling_params import SamplingParams

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


def _tokens(out: RequestOutput) -> list[list[int]]:
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
