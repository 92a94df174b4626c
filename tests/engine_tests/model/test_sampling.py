"""Sampling through the offline API on the embedded tiny model: seeds, n > 1 sharing, stops,
logprobs, penalties."""

from __future__ import annotations

import pytest
import torch

from quire_engine import LLM, SamplingParams
from quire_engine.core.sampling_params import SamplingParams as SP
from quire_engine.model.sampler import SampleRow, sample


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", device="cpu", num_blocks=512, max_model_len=512, seed=0)


def test_embedded_model_and_string_prompts(llm: LLM) -> None:
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out) == 1
    result = out[0]
    assert result.prompt == "Hello"
    assert result.prompt_token_ids == [256, *b"Hello"]  # BOS then bytes
    assert len(result.outputs[0].token_ids) == 8
    assert result.finished and result.outputs[0].finish_reason == "length"


def test_seeded_sampling_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate("The seed", seeded)[0].outputs[0].token_ids
    again = llm.generate("The seed", seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = (
        llm.generate(
            ["noise one", "The seed", "another prompt of a different length"],
            [others, seeded, others],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == again == batched
    different = llm.generate(
        "The seed",
        SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=99, ignore_eos=True),
    )[0]
    assert different.outputs[0].token_ids != alone


def test_parallel_samples_share_prompt_blocks() -> None:
    llm = LLM("tiny", device="cpu", num_blocks=256, max_model_len=256, enable_prefix_caching=False)
    engine = llm.engine
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks + 8 tokens in a third
    params = SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)

    def peak_blocks(requests: list[tuple[str, SamplingParams]]) -> tuple[int, list]:
        for rid, p in requests:
            engine.add_request(rid, prompt, p)
        peak, outs = 0, []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
            peak = max(peak, llm.kv_cache_stats().used)
        return peak, outs

    shared_peak, shared_out = peak_blocks([("n4", params)])
    single = SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
    separate_peak, _ = peak_blocks([(f"s{i}", single) for i in range(4)])
    # 60 tokens per sample = 4 blocks each. Sharing: 2 prompt blocks once, then per sample its
    # own third block (3 CoW copies + the original) and its fourth: 2 + 4 + 4 = 10.
    assert separate_peak == 16
    assert shared_peak == 10
    outs = shared_out[0].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 20 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 4  # different samples
    assert llm.kv_cache_stats().used == 0


def test_n_greater_than_one_with_one_token(llm: LLM) -> None:
    out = llm.generate("x", SamplingParams(n=3, temperature=1.0, max_tokens=1, seed=3))[0]
    assert [len(o.token_ids) for o in out.outputs] == [1, 1, 1]
    assert all(o.finish_reason in ("length", "stop") for o in out.outputs)


def test_greedy_n2_gives_identical_samples(llm: LLM) -> None:
    out = llm.generate("abc", SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))
    a, b = out[0].outputs
    assert a.token_ids == b.token_ids and (a.index, b.index) == (0, 1)


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    base = llm.generate(
        "stop test", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )[0].outputs[0]
    tokens = base.token_ids
    # Stop on the 5th generated token id.
    out = llm.generate(
        "stop test",
        SamplingParams(
            temperature=0.0, max_tokens=30, stop_token_ids=(tokens[4],), ignore_eos=True
        ),
    )
    first = tokens.index(tokens[4])
    assert out[0].outputs[0].token_ids == tokens[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].stop_reason == tokens[4]
    # Stop on a piece of the greedy text: output text ends right before it.
    text = base.text
    printable = [i for i in range(2, len(text) - 1) if text[i].isprintable()]
    if printable:
        cut = printable[0]
        stop = text[cut : cut + 1]
        res = llm.generate(
            "stop test",
            SamplingParams(temperature=0.0, max_tokens=30, stop=(stop,), ignore_eos=True),
        )[0].outputs[0]
        assert res.finish_reason == "stop" and res.stop_reason == stop
        assert res.text == text[: text.index(stop)]


def test_logprobs_and_cumulative(llm: LLM) -> None:
    out = llm.generate(
        "lp", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is the top-1
        assert entry[token] == max(entry.values())
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total)


def test_penalties_apply_to_generated_tokens_only() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.5]])
    params = SamplingParams(
        temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=0
    )
    # Token 2 was generated twice: 5.0 - 2 * 0.5 - 0.25 = 3.75 < 4.5, so token 3 wins.
    result = sample(logits, [SampleRow(params, None, [2, 2])])
    assert result.token_ids == [3]
    expected = torch.log_softmax(torch.tensor([0.0, 1.0, 3.75, 4.5]), dim=-1)[3]
    assert result.logprobs == [pytest.approx(float(expected))]
    # Without generated tokens nothing is penalised.
    assert sample(logits, [SampleRow(params, None, [])]).token_ids == [2]


def test_filters_restrict_the_draw() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {
        name: {
            sample(logits, [SampleRow(p, torch.Generator().manual_seed(i), [])]).token_ids[0]
            for i in range(200)
        }
        for name, p in {
            "top_k=2": SamplingParams(top_k=2),
            "top_p=0.7": SamplingParams(top_p=0.7),  # 0.5 + 0.3 reaches 0.7
            "min_p=0.25": SamplingParams(min_p=0.25),  # keeps p >= 0.125
            "all": SamplingParams(),
        }.items()
    }
    assert seen == {
        "top_k=2": {0, 1},
        "top_p=0.7": {0, 1},
        "min_p=0.25": {0, 1, 2},
        "all": {0, 1, 2, 3},
    }


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate("k", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    topk = llm.generate(
        "k", SamplingParams(temperature=1.5, top_k=1, max_tokens=10, seed=5, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == topk[0].outputs[0].token_ids


BEYOND_INT64 = 2**64  # the seed of issue 10 that used to kill the server
NOT_NUMBERS: list[object] = [float("nan"), float("inf"), float("-inf"), "1", True, None, [1]]


def _bad_values() -> list[tuple[str, object, str]]:
    """(field, value, message regex) for every numeric field at its extremes."""
    cases: list[tuple[str, object, str]] = []
    floats = {
        "temperature": (r"\[0, 2\]", [-1e-300, -0.5, 2.0000001, 1e308, BEYOND_INT64]),
        "top_p": (r"\(0, 1\]", [0, 0.0, -1.0, 1.5, 1e308]),
        "min_p": (r"\[0, 1\]", [-1e-9, 1.0000001, 2.0, BEYOND_INT64]),
        "presence_penalty": (r"\[-2, 2\]", [-2.5, 3.0, -(2**70), 1e308]),
        "frequency_penalty": (r"\[-2, 2\]", [-2.0001, 2.0001, 10**30]),
    }
    for name, (span, values) in floats.items():
        cases += [(name, v, f"{name} must be in {span}") for v in values]
        cases += [(name, v, f"{name} must be a finite number") for v in NOT_NUMBERS]
    ints = {
        "n": (r"in \[1, 1024\]", [0, -1, 1025, BEYOND_INT64]),
        "top_k": (r"in \[1, 9223372036854775807\] or None", [0, -1, 2**63, BEYOND_INT64]),
        "max_tokens": (">= 1", [0, -1, -(2**70)]),
        "logprobs": (r"in \[0, 20\]", [-1, 21, BEYOND_INT64]),
        "seed": (r"in \[-9223372036854775808, 9223372036854775807\]", [BEYOND_INT64, 2**63]),
    }
    for name, (span, int_values) in ints.items():
        cases += [(name, v, f"{name} must be {span}") for v in int_values]
        cases += [
            (name, v, f"{name} must be an integer")
            for v in [1.0, 0.5, float("nan"), float("inf"), "3", True, [1]]
        ]
    cases += [
        ("seed", -(2**63) - 1, "seed must be in"),
        ("stop", [""], "stop strings must be non-empty"),
        ("stop", ["x" * 257], "at most 256 characters"),
        ("stop", [f"s{i}" for i in range(33)], "stop must have at most 32 strings"),
        ("stop", [5], "stop strings must be non-empty strings"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop_token_ids", list(range(33)), "stop_token_ids must have at most 32 ids"),
        ("stop_token_ids", [-1], r"stop_token_ids must be in \[0, "),
        ("stop_token_ids", [BEYOND_INT64], r"stop_token_ids must be in \[0, "),
        ("stop_token_ids", ["1"], "stop_token_ids must be an integer"),
        ("stop_token_ids", 7, "stop_token_ids must be a list of integers"),
        ("ignore_eos", 1, "ignore_eos must be true or false"),
        ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be true or false"),
    ]
    return cases


@pytest.mark.parametrize(("name", "value", "message"), _bad_values())
def test_bad_sampling_params_name_the_field(name: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SP(**{name: value})  # type: ignore[arg-type]


def test_extreme_but_valid_values() -> None:
    assert SP(temperature=1e-300).greedy and SP(temperature=0).greedy
    assert SP(temperature=1e-3).temperature == 0.01  # vLLM's floor against inf/NaN logits
    assert not SP(temperature=1e-3).greedy
    assert SP(temperature=2).temperature == 2
    assert SP(seed=2**63 - 1).seed == 2**63 - 1 and SP(seed=-(2**63)).seed == -(2**63)
    assert SP(top_k=2**63 - 1).top_k == 2**63 - 1  # capped at the vocabulary when sampling
    assert SP(max_tokens=2**70).max_tokens == 2**70  # capped by max_model_len when scheduling
    assert SP(top_p=1e-300).top_p == 1e-300
    # The annotation says tuple; a single string is accepted too (and is what this checks).
    assert SP(stop="end").stop == ("end",)  # type: ignore[arg-type]
