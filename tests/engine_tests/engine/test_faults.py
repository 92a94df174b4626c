"""One request can fail; the engine cannot (offline engine, issue 10).

Faults are injected by wrapping the engine's own collaborators (sampling, the detokenizer, stop
checks, beam steps, generator creation, the model forward) so that they raise for one marked
request only. The poisoned request finishes with ``finish_reason`` "abort" and ``error``; no
block stays referenced (the autouse fixture checks the pool after each test).

The healthy requests must come out token-identical to a clean run of the same batch. To make
that exact (never hinging on a float near-tie), the fault strikes while the poisoned request
produces its last token: until then both runs compute bit-identical batches, and the step of
the fault feeds everyone identical logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.core import beam_search
from quire_engine.core import request_table as table_module
from quire_engine.core.detokenizer import Detokenizer
from quire_engine.core.outputs import RequestOutput
from quire_engine.engine import llm_engine as engine_module
from quire_engine.engine import output_processor
from quire_engine.model.sampler import SampleRow

POISON_SEED = 666_666
LAST = 8  # max_tokens of every request here; faults strike at the last token
GREEDY = SamplingParams(temperature=0.0, max_tokens=LAST, ignore_eos=True)
PROMPTS = ["first healthy prompt", "second one", "a third, longer healthy prompt"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", num_blocks=128, max_model_len=128, max_num_seqs=8)


def run(llm: LLM, poisoned: str | list[int], params: SamplingParams) -> list[RequestOutput]:
    return llm.generate([*PROMPTS, poisoned], [GREEDY, GREEDY, GREEDY, params])


def assert_unharmed(llm: LLM, outs: list[RequestOutput], clean: list[RequestOutput]) -> None:
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in clean]
    assert all(out.error is None and out.outputs[0].finish_reason == "length" for out in outs)
    assert not llm.engine.has_unfinished()
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.kv_cache_stats().used == 0


def assert_failed(out: RequestOutput, what: str, n: int = 1) -> None:
    assert out.finished and out.error is not None and what in out.error, out.error
    assert len(out.outputs) == n and all(o.finish_reason == "abort" for o in out.outputs)


def poisoned_sample(real: Callable[..., Any]) -> Callable[..., Any]:
    def sample(logits: Any, rows: list[SampleRow]) -> Any:
        if any(r.params.seed == POISON_SEED and len(r.output_token_ids) == LAST - 1 for r in rows):
            raise RuntimeError("injected sampling fault")
        return real(logits, rows)

    return sample


@pytest.mark.parametrize("n", [1, 3])
def test_a_fault_in_one_requests_sampling_fails_only_that_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    bad = SamplingParams(n=n, temperature=1.0, seed=POISON_SEED, max_tokens=LAST)
    clean = run(llm, "poisoned", bad)
    monkeypatch.setattr(engine_module, "sample", poisoned_sample(engine_module.sample))
    outs = run(llm, "poisoned", bad)
    assert_failed(outs[3], "injected sampling fault", n)
    assert_unharmed(llm, outs[:3], clean[:3])
    monkeypatch.undo()
    assert_unharmed(llm, run(llm, "poisoned", bad)[:3], clean[:3])  # and the engine goes on


@pytest.mark.parametrize("n", [1, 3])
def test_a_fault_in_detokenization_after_the_fork_fails_only_that_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    marker = [7, 7, 7]  # a prompt of token ids no healthy prompt ends with

    class Poisoned(Detokenizer):
        def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
            super().__init__(tokenizer, prompt_token_ids)
            self.poisoned = prompt_token_ids == marker
            self.calls = 0

        def add(self, token_id: int) -> str:
            self.calls += 1
            if self.poisoned and self.calls == LAST:  # the request's last token
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return super().add(token_id)

    bad = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=LAST)
    clean = run(llm, marker, bad)
    monkeypatch.setattr(table_module, "Detokenizer", Poisoned)
    outs = run(llm, marker, bad)
    # The n samples were forked long before the fault: all of them ended, their blocks came back.
    assert_failed(outs[3], "UnicodeDecodeError", n)
    assert_unharmed(llm, outs[:3], clean[:3])


def test_a_fault_in_stop_checking_fails_only_that_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = output_processor.find_stop
    calls = [0]

    def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> Any:
        if "POISON" in stops:
            calls[0] += 1  # once per token of the poisoned request
            if calls[0] == LAST:
                raise IndexError("injected stop-check fault")
        return real(text, new_len, stops)

    bad = SamplingParams(temperature=0.0, max_tokens=LAST, stop=("POISON",), ignore_eos=True)
    clean = run(llm, "stop me", bad)
    monkeypatch.setattr(output_processor, "find_stop", find_stop)
    outs = run(llm, "stop me", bad)
    assert_failed(outs[3], "injected stop-check fault")
    assert_unharmed(llm, outs[:3], clean[:3])


def test_a_fault_in_one_beam_step_fails_only_that_beam_search(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def beams(out: RequestOutput) -> list[tuple[Sequence[int], float | None, str | None]]:
        return [(o.token_ids, o.cumulative_logprob, o.finish_reason) for o in out.outputs]

    prompts = ["beam a", "beam poisoned", "beam b"]
    clean = llm.beam_search(prompts, beam_width=3, max_tokens=6)
    real = beam_search.advance

    def advance(table: Any, req: Any, state: Any, eos: Any) -> None:
        tokens = len(table.owner(state.active[0])[1].seq.output_token_ids)
        if req.prompt == "beam poisoned" and tokens == 5:  # the last step
            raise KeyError("injected beam fault")
        real(table, req, state, eos)

    monkeypatch.setattr(beam_search, "advance", advance)
    outs = llm.beam_search(prompts, beam_width=3, max_tokens=6)
    assert outs[1].error is not None and "injected beam fault" in outs[1].error
    assert [beams(outs[0]), beams(outs[2])] == [beams(clean[0]), beams(clean[2])]
    assert llm.kv_cache_stats().used == 0


def test_add_is_transactional(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(llm, "fine", GREEDY)
    engine = llm.engine
    sched = engine.scheduler

    def untouched() -> None:
        assert engine.num_requests == 0 and not sched.seqs and not sched.waiting
        assert llm.kv_cache_stats().used == 0

    # Limits only the engine knows: nothing queued, nothing half-added.
    with pytest.raises(ValueError, match="n=9 exceeds max_num_seqs=8"):
        engine.add_request("a", "x", SamplingParams(n=9))
    untouched()
    with pytest.raises(ValueError, match="beam_width=9 exceeds max_num_seqs=8"):
        engine.add_request("b", "x", SamplingParams(temperature=0.0), beam_width=9)
    untouched()
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 320\); got \[320\]"):
        engine.add_request("c", "x", SamplingParams(stop_token_ids=(320,)))
    untouched()
    with pytest.raises(ValueError, match="more than max_model_len=128"):
        engine.add_request("d", "y" * 200, GREEDY)
    untouched()
    # The crash of issue 10: the sequence was queued, then building its sample raised. Now every
    # sample part is built before the scheduler sees the sequence.
    monkeypatch.setattr(engine, "_fork_generator", _raise(RuntimeError("Overflow when unpacking")))
    with pytest.raises(RuntimeError, match="Overflow"):
        engine.add_request("e", "x", SamplingParams(seed=1))
    untouched()
    monkeypatch.undo()
    engine.add_request("dup", "x", GREEDY)
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        engine.add_request("dup", "other", GREEDY)
    assert engine.num_requests == 1 and list(sched.seqs) == ["dup/0"]
    engine.abort_request("dup")
    untouched()
    assert_unharmed(llm, run(llm, "fine", GREEDY), clean)


def test_a_failing_forward_fails_the_batch_and_frees_everything(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm.engine.runner, "execute", _raise(RuntimeError("CUDA error: injected")))
    with pytest.raises(RuntimeError, match="CUDA error: injected"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.engine.has_unfinished() and llm.kv_cache_stats().used == 0


def test_n_counts_against_max_num_seqs() -> None:
    llm = LLM(device="cpu", num_blocks=128, max_model_len=64, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", f"prompt {i}", params)
    peak = 0
    finished = 0
    while engine.has_unfinished():
        finished += sum(out.finished for out in engine.step())
        peak = max(peak, engine.scheduler.num_running)
    # 3 + 3 would fit the old check (one running sequence < 4) and then fork to 6.
    assert peak == 3 and finished == 3


def test_extreme_but_valid_values_generate() -> None:
    llm = LLM(device="cpu", num_blocks=64, max_model_len=64)
    cases = [
        SamplingParams(top_k=2**63 - 1, max_tokens=4, seed=1),  # capped at the vocabulary
        SamplingParams(temperature=1e-3, max_tokens=4, seed=2),  # raised to 0.01
        SamplingParams(temperature=1e-300, max_tokens=4),  # greedy
        SamplingParams(temperature=2.0, top_p=1e-300, max_tokens=4, seed=3),  # top-1
        SamplingParams(n=3, seed=2**63 - 1, max_tokens=4),  # seed + j beyond int64
        SamplingParams(seed=-(2**63), min_p=1.0, max_tokens=4),
        SamplingParams(presence_penalty=2, frequency_penalty=-2, max_tokens=4, seed=4),
        SamplingParams(stop=tuple(f"stop{i}" for i in range(32)), stop_token_ids=tuple(range(32))),
        SamplingParams(temperature=0.0, max_tokens=2**70, ignore_eos=True),  # to max_model_len
        SamplingParams(logprobs=20, max_tokens=4, seed=5),
    ]
    outs = llm.generate(["extreme"] * len(cases), cases)
    assert all(out.finished and out.error is None for out in outs)
    longest = outs[8]
    assert len(longest.prompt_token_ids) + len(longest.outputs[0].token_ids) == 64
    assert longest.outputs[0].finish_reason == "length"
    assert len(outs[4].outputs) == 3 and len(outs[9].outputs[0].logprobs or []) == 4
    assert llm.kv_cache_stats().used == 0


def _raise(error: Exception) -> Callable[..., Any]:
    def fail(*_: object, **__: object) -> Any:
        raise error

    return fail
