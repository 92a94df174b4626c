"""LoRA adapters under tensor parallelism (CPU, gloo): every rank holds its shard of each adapter,
and the tokens are those of peft's merged model and of one rank.

The adapters, references and tie-proofing are ``model/test_lora``'s: random peft adapters (A and
B random) of two ranks and target sets mixed with the base model in one call, each prompt's
greedy tokens compared with transformers on peft's ``merge_and_unload()`` model up to the
reference's first near-tie. Llama (separate q/k/v and gate/up projections) runs by default;
Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) and Qwen 2 (biased q/k/v) are ``slow``, as the
other architectures of ``test_tensor_parallel`` are. Every case covers column-parallel
projections (B split by output rows) and row-parallel ones (``o_proj``, ``down_proj``: A split
by input columns, the update summed by the layer's all-reduce).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.core.lora import LoRARequest
from tests.engine_tests.model.test_lora import (
    MAX_TOKENS,
    MLP,
    PROMPTS,
    check_against,
    family_setup,
    make_adapter,
    reference,
    tie_free_prefix,
)
from tests.engine_tests.models import build

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = {"device": "cpu", "dtype": "float32", "num_blocks": 64, "max_model_len": 128}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-tp")


def mixed_batch(base: Path, a: LoRARequest, b: LoRARequest, tp: int) -> list[list[int]]:
    """Every prompt under the base model and both adapters, interleaved in one call; the tokens
    grouped back by reference (every prompt's base, then adapter a, then adapter b)."""
    prompts = [p for p in PROMPTS for _ in range(3)]
    loras = [None, a, b] * len(PROMPTS)
    with LLM(
        str(base),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        tensor_parallel_size=tp,
        **ENGINE,
    ) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=loras)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return [tokens[k * 3 + j] for j in range(3) for k in range(len(PROMPTS))]


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        pytest.param("phi3", marks=pytest.mark.slow),
        pytest.param("qwen2", marks=pytest.mark.slow),
    ],
)
def test_a_mixed_batch_at_two_ranks_matches_merged_models_and_one_rank(
    workdir: Path, arch: str
) -> None:
    base, ((a, a_ref), (b, b_ref)) = family_setup(workdir, arch)
    refs = [str(r) for r in (base, a_ref, b_ref) for _ in PROMPTS]
    two = mixed_batch(base, a, b, 2)
    check_against(two, refs, f"{arch} TP=2 mixed batch")
    one = mixed_batch(base, a, b, 1)
    for i, ref in enumerate(refs):
        n = tie_free_prefix(reference(ref)[i % len(PROMPTS)][1])
        assert two[i][:n] == one[i][:n], f"{arch}: prompt {i} ({ref}) differs from TP=1"
    # The adapters change the output (or the test would prove nothing).
    assert two[len(PROMPTS)] != two[0] and two[2 * len(PROMPTS)] != two[0]


def test_removed_adapters_and_refusals_reach_every_rank(workdir: Path) -> None:
    """One slot, max_lora_rank 4: refusals carry TP=1's messages (checked on the whole shapes);
    an adapter removed and its id taken by another one (row-parallel targets only) runs the new
    adapter on every rank (a rank still holding the old one would refuse the id, and die), and
    none of the blocks the first one left in the prefix cache."""
    base, ((a, _), (b, b_ref)) = family_setup(workdir, "llama")
    c, c_ref = make_adapter(base, workdir, "llama-c", 3, 4, ["o_proj", *MLP])
    other = workdir / "narrow-llama"  # another base model: a narrower MLP
    if not other.exists():
        build("llama", other, intermediate_size=96)
    foreign, _ = make_adapter(other, workdir, "foreign", 4, 2, ["down_proj"])
    prompt = PROMPTS[0]

    def check(tokens: list[int], ref: Path) -> None:
        expected, margins = reference(str(ref))[0]
        n = tie_free_prefix(margins)
        assert n >= MAX_TOKENS // 2 and tokens[:n] == expected[:n]

    with LLM(
        str(base),
        enable_lora=True,
        max_loras=1,
        max_lora_rank=4,
        tensor_parallel_size=2,
        **ENGINE,
    ) as llm:
        with pytest.raises(ValueError, match="rank 8; max_lora_rank is 4"):
            llm.generate([prompt], GREEDY, lora_request=a)
        with pytest.raises(ValueError, match="another base model"):
            llm.generate([prompt], GREEDY, lora_request=foreign)
        (out,) = llm.generate([prompt], GREEDY, lora_request=b)
        check(list(out.outputs[0].token_ids), b_ref)
        assert llm.engine.remove_adapter(b.lora_int_id)
        reused = LoRARequest("llama-c", b.lora_int_id, c.lora_path)
        (out,) = llm.generate([prompt], GREEDY, lora_request=reused)
        check(list(out.outputs[0].token_ids), c_ref)
        assert llm.kv_cache_stats().used == 0
