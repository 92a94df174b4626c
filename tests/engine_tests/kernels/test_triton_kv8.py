"""8-bit KV caches in the Triton kernels (issue 39): the KV write quantizing in place and paged
attention dequantizing its tiles, against the torch references on the same 8-bit pools
(``kernels.kv_quant`` owns the format).

- Under Triton's interpreter (CPU; run in a child pytest, as ``test_kernels.py`` explains):
  ``write_kv_triton`` is bit-exact against ``write_kv_reference`` (data bytes and scales,
  dynamic and fixed scales, ties included), and paged attention matches the reference within
  fp32 rounding for fp32 queries (the path that folds the V scale into P) and within fp16
  rounding for fp16 ones (the path that dequantizes the V tile). bf16 queries are GPU-only:
  the interpreter computes bf16 wrongly (the 16-bit kernel is off by ~1e9 there too).
- The 8-bit variants compile for an H100/H200 (sm_90) without a GPU: in ``test_kernels.py``'s
  ``test_kernels_compile_for_hopper``, beside the 16- and 32-bit ones.
- ``gpu``-marked (skipped without CUDA): the same comparisons on the device with vLLM's
  tolerances for an fp8 KV cache, and the engine end to end with ``kv_cache_dtype`` set.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from quire_engine.kernels.kv_cache_ops import write_kv, write_kv_reference, write_kv_triton
from quire_engine.kernels.kv_quant import QMAX, QUANTIZED_DTYPES, FixedScales, quantize
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import paged_attention_reference
from quire_engine.kernels.paged_attention_triton import paged_attention
from tests.engine_tests.kernels.test_kernels import (
    GPU_SPECS,
    LIVE,
    Batch,
    edges,
    make_batch,
    run_interpreter_suite,
)

gpu = pytest.mark.gpu  # skipped without CUDA by the root conftest's hook
FORMATS = pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES, ids=lambda d: str(d)[6:])


@pytest.fixture
def interpret() -> None:
    if not LIVE:
        pytest.skip("run by test_triton_kv8_interpreter_suite in a child process")


@pytest.mark.slow  # a child pytest under the interpreter: ~40 s
def test_triton_kv8_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an 8-bit tensor (fp8 NaN != NaN, -0 == 0: compare bits, not values)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ---------------------------------------------------------------------------------------------
# The write


def _write_inputs(
    kv_dtype: torch.dtype, key_dtype: torch.dtype, device: str = "cpu", tokens: int = 9
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key, value ``[tokens, 3, 24]`` (3 heads and 24 dims: both padded in the kernel) and their
    slots in a 6 x 4-slot pool. key is a transposed view, as the model produces it; its rows
    span 1e-6..1e2, so fp8 rows reach subnormals. Row 0 of value is all zeros (scale 1). Row 1
    holds QMAX (scale exactly 1) and the midpoints between neighbouring values of the format:
    exact ties, where the write must round half to even."""
    gen = torch.Generator().manual_seed(tokens)
    heads, dim = 3, 24
    key = torch.randn(heads, tokens, dim, generator=gen)
    key = (key * torch.logspace(-6, 2, tokens)[None, :, None]).transpose(0, 1)
    value = torch.randn(tokens, heads, dim, generator=gen) * 3
    value[0] = 0
    if kv_dtype is torch.int8:
        grid = torch.arange(0.0, 128.0)
    else:
        grid = torch.arange(128, dtype=torch.uint8).view(kv_dtype).float()
        grid = grid[grid.isfinite()].sort().values
    ties = (grid[1:] + grid[:-1]) / 2  # midpoints of adjacent non-negative values
    picks = torch.randperm(ties.numel(), generator=gen)[: heads * (dim - 1)].view(heads, -1)
    sign = torch.where(torch.rand(picks.shape, generator=gen) < 0.5, -1.0, 1.0)
    value[1, :, 0] = QMAX[kv_dtype]
    value[1, :, 1:] = ties[picks] * sign
    slots = torch.randperm(24, generator=gen)[:tokens]
    return key.to(device, key_dtype), value.to(device, key_dtype), slots.to(device)


def _write_both(
    kv_dtype: torch.dtype,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    fixed: FixedScales | None,
) -> list[tuple[torch.Tensor, ...]]:
    """(k_cache, v_cache, k_scale, v_scale) written by the kernel on ``key``'s device and by the
    reference on CPU, from pools of arbitrary bytes and NaN scales (every written slot must be
    overwritten, no other one touched)."""
    gen = torch.Generator().manual_seed(7)
    start = torch.randint(-128, 128, (6, 4, 3, 24), dtype=torch.int8, generator=gen)
    pools = []
    for device, write in ((key.device, write_kv_triton), (torch.device("cpu"), write_kv_reference)):
        if device.type == "cuda":
            write = write_kv  # the engine's dispatch: the Triton kernel on CUDA
        k_cache, v_cache = (start.view(kv_dtype).clone().to(device) for _ in range(2))
        k_scale, v_scale = (torch.full((6, 4, 3), float("nan"), device=device) for _ in range(2))
        write(
            key.to(device), value.to(device), k_cache, v_cache, slots.to(device),
            k_scale=k_scale, v_scale=v_scale, fixed=fixed,
        )  # fmt: skip
        pools.append(tuple(t.cpu() for t in (k_cache, v_cache, k_scale, v_scale)))
    return pools


def _assert_same_pools(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), got, want, strict=True):
        same = (_bits(a) == _bits(b)) | (a.isnan() & b.isnan())  # unwritten scales stay NaN
        assert bool(same.all()), f"{name}: {int((~same).sum())} elements differ"


@FORMATS
@pytest.mark.parametrize("fixed", [None, FixedScales(0.02, 0.5)], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_interpreted_write_kv_is_bit_exact(
    interpret: None, kv_dtype: torch.dtype, fixed: FixedScales | None, key_dtype: torch.dtype
) -> None:
    """Bytes and scales identical to the reference's, ties, subnormals and saturation (fixed
    scale 0.02: K values past 0.02 * QMAX clamp) included; a non-contiguous key."""
    key, value, slots = _write_inputs(kv_dtype, key_dtype)
    assert not key.is_contiguous()
    got, want = _write_both(kv_dtype, key, value, slots, fixed)
    _assert_same_pools(got, want)


def test_interpreted_write_kv_refuses_bad_fixed_scales(interpret: None) -> None:
    key, value, slots = _write_inputs(torch.int8, torch.float32)
    pools = [torch.zeros(6, 4, 3, 24, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(6, 4, 3) for _ in range(2)]
    for bad in (FixedScales(0.0, 1.0), FixedScales(1.0, float("inf"))):
        for fn in (write_kv_triton, write_kv_reference):
            with pytest.raises(ValueError, match="positive and finite"):
                fn(key, value, pools[0], pools[1], slots, k_scale=scales[0], v_scale=scales[1],
                   fixed=bad)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        write_kv_triton(key, value, pools[0], pools[1], slots)  # 8-bit, without its scales


# ---------------------------------------------------------------------------------------------
# Attention


def quantize_batch(b: Batch, kv_dtype: torch.dtype) -> dict[str, object]:
    """Keyword arguments of the attention call over ``b``'s pools quantized to ``kv_dtype``
    (kv_quant's rule). Slots no sequence owns hold NaN in ``b``; here their scales are NaN, so
    reading one still shows up in the output."""
    pools: dict[str, torch.Tensor] = {}
    for name in ("k", "v"):
        cache = getattr(b, f"{name}_cache").float().cpu()
        q, scale = quantize(torch.nan_to_num(cache), kv_dtype)
        scale[cache.isnan().any(-1)] = float("nan")
        pools[f"{name}_cache"], pools[f"{name}_scale"] = q.to(b.q.device), scale.to(b.q.device)
    return {**b.kwargs(), **pools}


# (id, specs, heads, kv_heads, head_dim, block_size, sliding_window, softcap, split counts)
KV8_CASES = [
    # decode, prefill, and chunks after a cached prefix, ending on and past block boundaries
    ("mixed-gqa2-bs8", [(8, 1), (0, 9), (7, 10), (16, 1), (3, 2)], 4, 2, 64, 8, None, None, (1, 3)),
    ("decode-gqa4-bs32", [(n - 1, 1) for n in edges(32)], 4, 1, 64, 32, None, None, (1, 4)),
    ("gqa3-d80-bs16", [(10, 6), (17, 1)], 6, 2, 80, 16, None, None, (1, 2)),  # padded group, dims
    # a window (released blocks hold NaN scales) and a soft-cap
    ("win-mixed-bs16-w20", [(50, 1), (0, 45), (33, 12), (3, 1)], 8, 2, 32, 16, 20, None, (1, 3)),
    ("win-softcap-bs16", [(40, 1), (10, 30), (0, 3)], 4, 1, 16, 16, 12, 2.0, (1, 3)),
]
# Kernel against reference on the same 8-bit pools. fp32 queries: the dequantization is exact up
# to fp32 rounding (the 16-bit test's 1e-5). fp16 queries: P and the dequantized V tile are
# rounded to fp16 (2^-11 relative each) before their dot, and both outputs to fp16.
TOLERANCE = {torch.float32: (1e-5, 0.0), torch.float16: (1e-3, 2e-3)}


def _case_params(q_dtypes: tuple[torch.dtype, ...]) -> list[object]:
    return [
        pytest.param(*case[1:], q_dtype, id=f"{case[0]}-{str(q_dtype)[6:]}")
        for case in KV8_CASES
        for q_dtype in q_dtypes
        if q_dtype is torch.float32 or case[0] in ("mixed-gqa2-bs8", "win-softcap-bs16")
    ]


@FORMATS
@pytest.mark.parametrize(
    ("specs", "heads", "kv_heads", "head_dim", "block_size", "window", "softcap", "splits",
     "q_dtype"),
    _case_params((torch.float32, torch.float16)),
)  # fmt: skip
def test_interpreted_kernel_kv8_matches_reference(
    interpret: None,
    kv_dtype: torch.dtype,
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    softcap: float | None,
    splits: tuple[int, ...],
    q_dtype: torch.dtype,
) -> None:
    b = make_batch(
        specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        sliding_window=window, softcap=softcap, seed=block_size,
    )  # fmt: skip
    inputs = PagedAttentionInputs(**{**quantize_batch(b, kv_dtype), "q": b.q.to(q_dtype)})  # type: ignore[arg-type]
    expected = paged_attention_reference(inputs)
    assert not expected.isnan().any()
    atol, rtol = TOLERANCE[q_dtype]
    for num_splits in splits:
        out = paged_attention(inputs, num_splits=num_splits)
        assert out.dtype == q_dtype
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol, msg=f"{num_splits=}")


def test_interpreted_kernel_kv8_honours_strides_and_tiny_values(interpret: None) -> None:
    """Scale pools as strided views, and K/V of magnitude ~1e-3 in e5m2
    (scales ~1e-8: P times the V scale would underflow in fp16, so the fp16 path must scale the
    V tile instead)."""
    b = make_batch([(20, 1), (3, 5)], heads=4, kv_heads=2, head_dim=32, block_size=8)
    b = replace(b, k_cache=b.k_cache * 1e-3, v_cache=b.v_cache * 1e-3, q=b.q * 1e2)
    kwargs = quantize_batch(b, torch.float8_e5m2)
    paired = torch.randn(*b.k_cache.shape[:3], 2)  # K and V scales interleaved: stride 2
    paired[..., 0], paired[..., 1] = kwargs["k_scale"], kwargs["v_scale"]  # type: ignore[assignment]
    strided = {**kwargs, "k_scale": paired[..., 0], "v_scale": paired[..., 1]}
    assert not strided["k_scale"].is_contiguous()  # type: ignore[attr-defined]
    for q_dtype in (torch.float32, torch.float16):
        inputs = PagedAttentionInputs(**{**strided, "q": b.q.to(q_dtype)})  # type: ignore[arg-type]
        expected = paged_attention_reference(inputs)
        scale = float(expected.abs().max())
        assert 1e-4 < scale < 1e-2
        atol, rtol = TOLERANCE[q_dtype]
        torch.testing.assert_close(
            paged_attention(inputs, num_splits=2), expected, atol=atol * scale, rtol=rtol
        )


# ---------------------------------------------------------------------------------------------
# CUDA


@gpu
@FORMATS
@pytest.mark.parametrize("fixed", [None, FixedScales(0.02, 0.5)], ids=["dynamic", "fixed"])
def test_cuda_write_kv_kv8_is_bit_exact(kv_dtype: torch.dtype, fixed: FixedScales | None) -> None:
    """write_kv on CUDA (the Triton kernel) writes the bytes and scales the CPU reference
    writes, from the model's dtypes; vLLM's cache test allows fp8 round trips atol 1e-3, rtol
    0.1, but the rule here is exact, so the check is bit for bit."""
    for key_dtype in (torch.bfloat16, torch.float16, torch.float32):
        key, value, slots = _write_inputs(kv_dtype, key_dtype, device="cuda", tokens=24)
        got, want = _write_both(kv_dtype, key, value, slots, fixed)
        _assert_same_pools(got, want)


# vLLM's tests/kernels/attention/test_attention.py: atol 1e-2, rtol 1e-5 with an fp8 KV cache
# (kernel against a reference on the dequantized cache), for data of magnitude <= 1. Here K and
# V are scaled to that range (randn / 4), where bf16's own rounding (2^-9 relative, on P and on
# the output) stays under 5e-3.
VLLM_FP8_KV_ATOL, VLLM_FP8_KV_RTOL = 1e-2, 1e-5


@gpu
@FORMATS
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernel_kv8_matches_reference(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    for seed, specs in enumerate(GPU_SPECS):
        for window, softcap in ((None, None), (100, None), (1000, 50.0), (None, 20.0)):
            b = make_batch(
                specs, heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=q_dtype,
                device="cuda", seed=seed, sliding_window=window, softcap=softcap,
            )  # fmt: skip
            b = replace(b, k_cache=b.k_cache / 4, v_cache=b.v_cache / 4)
            inputs = PagedAttentionInputs(**quantize_batch(b, kv_dtype))  # type: ignore[arg-type]
            expected = paged_attention_reference(inputs)
            assert not expected.isnan().any()
            for num_splits in (None, 1, 5):
                torch.testing.assert_close(
                    paged_attention(inputs, num_splits=num_splits), expected,
                    atol=VLLM_FP8_KV_ATOL, rtol=VLLM_FP8_KV_RTOL,
                    msg=f"{specs} {window=} {softcap=} {num_splits=}",
                )  # fmt: skip


@gpu
@FORMATS
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_cuda_engine_with_8bit_kv_cache(
    kv_dtype: torch.dtype, arch: str, model_dirs: dict[str, Path]
) -> None:
    """The engine on CUDA with ``kv_cache_dtype`` set (the Triton write and attention; Gemma 2:
    a window and a soft-cap), swap preemption forced by a small pool: greedy output close to the
    same format's CPU run without preemption, by the CPU 8-bit equivalence test's rule (vLLM's
    check_logprobs_close, with its per-format log-probability drift)."""
    from quire_engine import LLM, SamplingParams
    from quire_engine.core.config import KVCacheDtype, PreemptionMode
    from tests.engine_tests.model.test_kv8_equivalence import (
        LOGPROB_DRIFT,
        _oracle,
        check_logprobs_close,
    )
    from tests.engine_tests.model.test_llm_equivalence import MAX_TOKENS, prompts

    name = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    kv = KVCacheDtype(name[kv_dtype])
    path = str(model_dirs[arch])
    with LLM(
        path, device="cuda", dtype="float32", block_size=8, preemption_mode="swap",
        swap_space=0.01, num_blocks=16, max_model_len=128, kv_cache_dtype=kv.value,
    ) as llm:  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
        results = llm.generate(prompts(), params)
        runner = llm.engine.runner
        assert runner.use_triton and runner.k_caches[0].dtype == kv_dtype
        assert llm.engine.scheduler.num_preemptions[PreemptionMode.SWAP] > 0
    agreed = []
    for i, (want, result) in enumerate(zip(_oracle(path, arch, kv), results, strict=True)):
        try:
            agreed.append(check_logprobs_close(want, result.outputs[0], LOGPROB_DRIFT[kv]))
        except AssertionError as exc:
            raise AssertionError(f"prompt {i}: {exc}") from exc
    assert sum(agreed) >= 0.5 * MAX_TOKENS * len(agreed), agreed
