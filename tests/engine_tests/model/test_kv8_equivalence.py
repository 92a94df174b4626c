"""8-bit KV pools on every architecture, under the five paging configurations (prefix caching,
no prefix caching, chunked prefill with a cached prefix, preemption by recompute and by swap):
paging never changes what an 8-bit pool computes beyond float rounding.

The oracle of a configuration is the same architecture and format with a pool large enough that
nothing is preempted (``prefix-bs16``). Blocks copied on write, swapped out and back, shared by a
prefix or released by a window hold the same bytes and scales (``kernels/test_kv_quant`` checks
the moves byte for byte); a recomputed prefill quantizes K/V computed in another batch shape,
which can move an element across a rounding boundary. So the rule is vLLM's
``check_logprobs_close`` (the paths agree, or each token is in the other's top 5, and the
comparison stops at the first difference) with the chosen token's log-probability within
``LOGPROB_DRIFT`` of the oracle's wherever the paths agree.

Why not against the float32 path here: these random-weight models have sharp attention (large
q.k), so a half-step error in K moves their logits by tenths of a nat (measured: 42 of 65
(architecture, configuration) runs broke vLLM's rule against float32 at the first token, with
the attention itself exactly that of the dequantized values). Distance from full precision is
measured where it means something, on a trained model (``test_kv8_accuracy``).

Each architecture runs one format (rotating, so every format meets several architectures and
every configuration): 65 engine runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import KVCacheDtype, PreemptionMode
from quire_engine.core.outputs import CompletionOutput
from tests.engine_tests.model.test_llm_equivalence import (
    ALL_LAYERS_SLIDING,
    MAX_TOKENS,
    VARIANTS,
    prompts,
)
from tests.engine_tests.models import ARCHITECTURES

FORMATS = (KVCacheDtype.INT8, KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2)
ORACLE = "prefix-bs16"
CONFIGS = ("noprefix-bs16", "chunked-prefill-bs8", "preempt-recompute", "preempt-swap")
TOP_K = 5
# Nats, where the paths agree: one element moved by one step of the format (int8: 1/254 of a
# row's range; e4m3 3 and e5m2 2 mantissa bits) in these sharp models.
LOGPROB_DRIFT = {KVCacheDtype.INT8: 0.05, KVCacheDtype.FP8_E4M3: 0.1, KVCacheDtype.FP8_E5M2: 0.2}


def _format(arch: str) -> KVCacheDtype:
    return FORMATS[list(ARCHITECTURES).index(arch) % len(FORMATS)]


def _run(
    model_dir: str, arch: str, config: str, kv_dtype: KVCacheDtype, **engine: object
) -> list[CompletionOutput]:
    kwargs: dict[str, object] = {"num_blocks": 64, "max_model_len": 128, **VARIANTS[config]}
    kwargs |= engine
    if "preemption_mode" in kwargs and arch in ALL_LAYERS_SLIDING:
        kwargs |= {"num_blocks": 11, "max_model_len": 88}  # as the float32 matrix: must preempt
    with LLM(
        model_dir, device="cpu", max_num_seqs=16, kv_cache_dtype=kv_dtype.value, **kwargs
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
        outputs = [r.outputs[0] for r in llm.generate(prompts(), params)]
        runner = llm.engine.runner
        assert runner.shape.kv_dtype is kv_dtype and runner.k_caches[0].element_size() == 1
        preemptions = llm.engine.scheduler.num_preemptions
    if "preemption_mode" in kwargs:
        assert preemptions[PreemptionMode(kwargs["preemption_mode"])] > 0
    else:
        assert sum(preemptions.values()) == 0
    return outputs


@functools.cache
def _oracle(model_dir: str, arch: str, kv_dtype: KVCacheDtype) -> list[CompletionOutput]:
    return _run(model_dir, arch, ORACLE, kv_dtype)


def check_logprobs_close(oracle: CompletionOutput, got: CompletionOutput, drift: float) -> int:
    """vLLM's rule with the drift bound (module docstring); how many leading positions agree."""
    assert oracle.logprobs is not None and got.logprobs is not None
    steps = zip(oracle.token_ids, got.token_ids, oracle.logprobs, got.logprobs, strict=True)
    for step, (want, token, want_top, top) in enumerate(steps):
        if token != want:
            assert token in want_top and want in top, f"step {step}: {token} vs {want}"
            return step
        assert abs(top[token] - want_top[want]) <= drift, (step, top[token], want_top)
    return len(got.token_ids)


def test_every_format_meets_several_architectures() -> None:
    assert {_format(arch) for arch in ARCHITECTURES} == set(FORMATS)


@pytest.mark.parametrize(("arch", "config"), [(a, c) for a in ARCHITECTURES for c in CONFIGS])
def test_paging_keeps_an_8bit_pool_logprob_close(
    arch: str, config: str, model_dirs: dict[str, Path]
) -> None:
    model_dir, kv_dtype = str(model_dirs[arch]), _format(arch)
    oracle = _oracle(model_dir, arch, kv_dtype)
    outputs = _run(model_dir, arch, config, kv_dtype)
    agreed = []
    for i, (want, got) in enumerate(zip(oracle, outputs, strict=True)):
        try:
            agreed.append(check_logprobs_close(want, got, LOGPROB_DRIFT[kv_dtype]))
        except AssertionError as exc:
            raise AssertionError(f"{kv_dtype.value}, prompt {i}: {exc}") from exc
    # Paging moves bytes, not values: nearly every path agrees to the end.
    assert sum(agreed) >= 0.9 * MAX_TOKENS * len(agreed), agreed


@pytest.mark.parametrize("config", ["prefix-bs16", "preempt-swap"])
def test_tensor_parallel_ranks_each_quantize_their_own_heads(
    config: str, model_dirs: dict[str, Path]
) -> None:
    """TP=2 with an 8-bit pool: each rank writes and reads its own KV heads' 8-bit rows and
    scales (the scales are per head, so sharding does not change them); the output is the one
    rank run's by the same rule."""
    arch, kv_dtype = "llama", KVCacheDtype.INT8
    model_dir = str(model_dirs[arch])
    oracle = _oracle(model_dir, arch, kv_dtype)
    outputs = _run(model_dir, arch, config, kv_dtype, tensor_parallel_size=2)
    agreed = [
        check_logprobs_close(want, got, LOGPROB_DRIFT[kv_dtype])
        for want, got in zip(oracle, outputs, strict=True)
    ]
    assert sum(agreed) >= 0.9 * MAX_TOKENS * len(agreed), agreed
