"""The benches' warm-up prompts share no prefix-cache block with the workload they warm up for,
checked through a real engine's prefix cache (which does revive the workload's own prompts)."""

from __future__ import annotations

import random

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.bench.workload import warm_up_prompts


def test_warm_up_prompts_keep_lengths_and_start_no_workload_prompt() -> None:
    rng = random.Random(0)
    ids = [[rng.randrange(1, 4) for _ in range(20)] for _ in range(6)]  # few distinct starts
    warm = warm_up_prompts(ids, 3)
    assert [len(w) for w in warm] == [20, 20, 20]
    assert all(
        w[1:] == p[1:] and w[0] not in {q[0] for q in ids}
        for w, p in zip(warm, ids[:3], strict=True)
    )
    text = ["ab", "!x", " y"]
    assert warm_up_prompts(text, 2) == ['"b', '"x']  # " " and "!" start workload prompts
    with pytest.raises(ValueError, match="count >= 1"):
        warm_up_prompts(ids, 0)


def test_warm_up_leaves_nothing_for_the_workload_to_revive() -> None:
    llm = LLM(device="cpu", num_blocks=64, max_model_len=96)
    kv = llm.engine.scheduler.kv
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 300) for _ in range(40)] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(warm_up_prompts(prompts, 3), params)
    assert kv.prefix_hits == 0
    llm.generate(prompts, params)
    assert kv.prefix_hits == 0
    llm.generate(prompts, params)  # the check can fail: the workload's own blocks are revived
    assert kv.prefix_hits == 3 * 32
