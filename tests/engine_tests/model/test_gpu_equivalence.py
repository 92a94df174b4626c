"""The engine on CUDA (skipped without a GPU): token-exact greedy output against transformers in
float32 for every architecture, and bfloat16 logits within bf16 tolerance on a ~134M-parameter
Llama, reporting where greedy outputs first diverge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from quire_engine import LLM, SamplingParams
from quire_engine.model.tiny_model import build_tokenizer
from tests.engine_tests.model.test_llm_equivalence import ALL_LAYERS_SLIDING, MAX_TOKENS, prompts
from tests.engine_tests.models import ARCHITECTURES, greedy_reference

pytestmark = pytest.mark.gpu  # skipped without CUDA by the root conftest's hook


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_cuda_float32_token_exact(arch: str, model_dirs: dict[str, Path]) -> None:
    """Every architecture through the Triton kernel (sliding windows, soft-caps, released
    blocks), with swap preemption forced by a small pool."""
    path = str(model_dirs[arch])
    # transformers wraps `cuda` with functools.wraps, which mypy cannot bind to the instance.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()  # type: ignore[call-arg]
    # Where every layer slides, released blocks leave room: one 88-token request's worth.
    pool = {"num_blocks": 11, "max_model_len": 88} if arch in ALL_LAYERS_SLIDING else {}
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        block_size=8,
        preemption_mode="swap",
        swap_space=0.01,
        **{"num_blocks": 16, "max_model_len": 128} | pool,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(prompts(), params)
    for p, result in zip(prompts(), results, strict=True):
        # The checkpoints are tie-free on these prompts (test_llm_equivalence checks it on CPU).
        assert result.outputs[0].token_ids == greedy_reference(model, p, MAX_TOKENS).tokens
    # The small pool forced preemption on the GPU.
    assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    assert llm.kv_cache_stats().used == 0


def test_cuda_pool_sized_by_profiling_an_eager_only_model(model_dirs: dict[str, Path]) -> None:
    """No num_blocks: the pool is sized by a profiling forward, which must run for Gemma 2
    (transformers refuses SDPA for it) and leave a token-exact engine."""
    path = str(model_dirs["gemma2"])
    # transformers wraps `cuda` with functools.wraps, which mypy cannot bind to the instance.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()  # type: ignore[call-arg]
    llm = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result = llm.generate([prompts()[2]], params)[0]
    assert result.outputs[0].token_ids == greedy_reference(model, prompts()[2], MAX_TOKENS).tokens


def test_cuda_bfloat16_logits_on_a_134m_model(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    params_count = sum(p.numel() for p in model.parameters())
    assert params_count >= 100_000_000
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    model = model.to("cuda", torch.bfloat16)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=512, max_model_len=2048)
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(1, 32000, (n,), generator=gen).tolist() for n in (5, 77, 300, 1023)]
    n = 32
    results = llm.generate(
        batch, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=20)
    )
    report = []
    for p, result in zip(batch, results, strict=True):
        ref = greedy_reference(model, p, n)
        ours = result.outputs[0]
        first_div = next(
            (i for i, (a, b) in enumerate(zip(ours.token_ids, ref.tokens, strict=True)) if a != b),
            None,
        )
        # Compare the first step (same prefix by construction): top-20 log-probabilities.
        assert ours.logprobs is not None
        diff = max(abs(lp - float(ref.logprobs[0, t])) for t, lp in ours.logprobs[0].items())
        report.append(
            {
                "prompt_len": len(p),
                "first_divergence": first_div,
                "first_step_max_logprob_diff": round(diff, 4),
            }
        )
        # bf16 has an 8-bit mantissa: logits of magnitude ~10 carry errors of a few 0.01.
        assert diff <= 0.15
    print(json.dumps({"model_params": params_count, "bf16_equivalence": report}))
