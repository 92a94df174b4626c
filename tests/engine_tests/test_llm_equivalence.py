"""The engine's contract: greedy output token-identical to transformers' ``generate`` on the same
weights, whatever the block size, prefix caching, or preemption, for every supported
architecture; last-step log-probabilities within 1e-4."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from quire_engine import LLM, SamplingParams
from quire_engine.config import PreemptionMode
from tests.engine_tests.models import ARCHITECTURES

MAX_TOKENS = 24
SHARED = list(range(20, 60))  # a 40-token shared prefix (2.5 blocks of 16)


def prompts() -> list[list[int]]:
    """Ten prompts of mixed lengths; five share a long prefix, two are identical."""
    return [
        [*SHARED, 1, 2, 3],
        [*SHARED, 4],
        [*SHARED, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
        [*SHARED],
        [*SHARED],
        [9],
        [100, 101, 102, 103, 104, 105, 106, 107],  # exactly one block of 8
        [200 + i % 50 for i in range(31)],
        [150 + i % 40 for i in range(64)],  # ends exactly on a block boundary for 8/16/32
        [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3],
    ]


@functools.cache
def hf_reference(model_dir: str) -> list[tuple[list[int], torch.Tensor]]:
    """transformers greedy: (tokens, last-step log-probabilities) per prompt, one at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos means "EOS does not stop", not "EOS is forbidden" (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts():
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=258,
        )
        tokens = gen.sequences[0, ids.shape[1] :].tolist()
        out.append((tokens, torch.log_softmax(gen.logits[-1][0].float(), dim=-1)))
    return out


VARIANTS = {
    "prefix-bs16": {"block_size": 16, "enable_prefix_caching": True},
    "noprefix-bs16": {"block_size": 16, "enable_prefix_caching": False},
    "prefix-bs8": {"block_size": 8, "enable_prefix_caching": True},
    "prefix-bs32": {"block_size": 32, "enable_prefix_caching": True},
    # 10 prompts growing to 25..88 tokens (590 in all) in 16 x 8 = 128 slots: must preempt.
    "preempt-recompute": {"block_size": 8, "num_blocks": 16, "preemption_mode": "recompute"},
    "preempt-swap": {
        "block_size": 8,
        "num_blocks": 16,
        "preemption_mode": "swap",
        "swap_space": 0.01,
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_matches_transformers(arch: str, variant: str, model_dirs: dict[str, Path]) -> None:
    model_dir = str(model_dirs[arch])
    reference = hf_reference(model_dir)
    # The reference must be diverse, or a broken kernel could pass by repeating one token.
    assert sum(len(set(tokens)) for tokens, _ in reference) > 8 * len(reference)

    kwargs: dict[str, object] = {"num_blocks": 64, "max_model_len": 128} | VARIANTS[variant]
    llm = LLM(model_dir, device="cpu", max_num_seqs=16, **kwargs)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    results = llm.generate(prompts(), params)

    for (tokens, ref_logprobs), result in zip(reference, results, strict=True):
        out = result.outputs[0]
        assert out.token_ids == tokens
        assert out.finish_reason == "length"
        last = out.logprobs[-1] if out.logprobs else {}
        assert len(last) >= 5
        for token, logprob in last.items():
            assert abs(logprob - float(ref_logprobs[token])) <= 1e-4, (token, logprob)

    sched = llm.engine.scheduler
    preemptions = sched.num_preemptions
    if variant.startswith("preempt"):
        assert preemptions[PreemptionMode(kwargs["preemption_mode"])] > 0
    else:
        assert sum(preemptions.values()) == 0
    if variant.startswith("prefix"):
        assert sched.kv.prefix_hits > 0  # the shared 40-token prefix was reused
    stats = llm.kv_cache_stats()
    assert stats.used == 0 and stats.free == stats.total
