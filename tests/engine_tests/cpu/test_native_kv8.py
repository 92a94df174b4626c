"""8-bit KV pools in the native CPU kernels: ``csrc/paged_decode.c`` reads int8, float8_e4m3fn
and float8_e5m2 blocks in place (``csrc/kv_quant.h`` widens them in registers),
``csrc/kv_quant.c`` writes them, and ``csrc/decoder_decode.c`` does both in a decode step.

What must hold, per format:

* the decode kernel computes what ``paged_attention_reference`` computes from the same 8-bit
  pools and scales, to rounding (1e-5 on O(1) outputs, as the float32 kernel's tests: the
  reference dequantizes each element, ``float(q) * s``, then runs float32 attention; the kernel
  scales each dot product and each softmax weight by the row's scale instead, which differs only
  by rounding), with grouped queries, sliding windows and soft-caps, whatever the batch or
  thread count (bit-identical rows);
* every code a write can produce reads back as exactly torch's float of it (one token, scale 1:
  the output is the V row itself), from the engine's build and from a portable one (no
  ``-march=native``: the path without the x86 vector conversions), and with denormals-are-zero
  set (the reads never pass through a float denormal);
* the C quantizer is ``kv_quant.quantize`` byte for byte, data and scales: over every float with
  its low 8 bits zero and every midpoint between neighbouring 8-bit values (the rounding
  decisions), and on rows of zeros, huge and tiny values, with dynamic and fixed scales;
* the native decode step on an 8-bit pool writes what the module path writes and its logits
  equal the module path's to 1e-4 of their scale (an 8-bit pool adds one source of difference
  to the float32 comparison's 1e-5: K/V that differ by rounding, from RMSNorm, may land on a
  neighbouring 8-bit code; held here to at most 1 element in 1,000, each one code apart), with
  greedy tokens identical (tie-proof) over 30 steps, with dynamic and with a checkpoint's fixed
  scales.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from quire_engine import LLM, SamplingParams
from quire_engine.cpu import native
from quire_engine.kernels.kv_quant import QMAX, quantize
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import paged_attention_reference
from quire_engine.model.runner import ModelRunner, StepPlan
from tests.engine_tests.cpu.test_native_decoder import _assert_tie_free, _prompts, _Recorder
from tests.engine_tests.cpu.test_native_kernels import _pool
from tests.engine_tests.models import build
from tests.engine_tests.toolchain import require_compiler, require_native_kernels

ATOL = RTOL = 1e-5
STEP_REL_TOL = 1e-4  # the native decode step against the module path, of the logits' scale
FORMATS = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
# An 8-bit layer's K data, V data, K scales, V scales.
Pools = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def quantizer() -> native.KvQuantize:
    require_native_kernels()
    built = native.kv_quantize()
    assert built is not None
    return built


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> native.PagedDecode:
    """The kernel built without -march=native (native.FLAG_SETS' portable fallback)."""
    require_compiler()
    return native.PagedDecode(native.build(("-fopenmp-simd",), tmp_path_factory.mktemp("k")))


def _codes(dtype: torch.dtype) -> torch.Tensor:
    """Every byte a write can produce in ``dtype`` (no NaN or inf codes), as ``dtype``."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    if dtype is torch.int8:
        return every[every != -128]  # symmetric range: -128 is never written
    return every[torch.isfinite(every.float())]


def _quantized_pool(
    lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[Pools, np.ndarray]:
    """8-bit K/V pools of random codes (half the rows of every code, half of small ones only:
    subnormals and the first normals, so that a misread one shows), with per-row scales that
    put each row's largest value between 0.5 and 2; and the block tables of ``_pool``."""
    _, _, tables = _pool(lens, block_size, kv_heads, head_dim, seed)
    gen = torch.Generator().manual_seed(seed)
    codes = _codes(dtype)
    small = codes[codes.float().abs() <= codes.float().abs().sort().values[32]]
    shape = (int(tables.max()) + 2, block_size, kv_heads, head_dim)
    pools = []
    for _ in range(2):
        every = codes[torch.randint(len(codes), shape, generator=gen)]
        low = small[torch.randint(len(small), shape, generator=gen)]
        data = torch.where(torch.rand(shape[:3], generator=gen)[..., None] < 0.5, every, low)
        amax = data.float().abs().amax(-1).clamp_min(1e-30)
        scale = (0.5 + 1.5 * torch.rand(shape[:3], generator=gen)) / amax
        pools += [data, scale]
    k, k_scale, v, v_scale = pools
    return (k, v, k_scale, v_scale), tables


def _reference(
    q: torch.Tensor,
    pools: Pools,
    tables: np.ndarray,
    lens: list[int],
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    k, v, k_scale, v_scale = pools
    n = len(lens)
    inputs = PagedAttentionInputs(
        q, k, v, torch.from_numpy(tables), torch.tensor(lens, dtype=torch.int32),
        torch.arange(n + 1, dtype=torch.int32), 0.3, max_query_len=1, max_seq_len=max(lens),
        sliding_window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return paged_attention_reference(inputs, finite_cache=True)


def _attend(
    kernel: native.PagedDecode,
    q: torch.Tensor,
    pools: Pools,
    tables: np.ndarray,
    lens: list[int],
    threads: int = 1,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    k, v, k_scale, v_scale = pools
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    rows = np.arange(len(lens), dtype=np.int64)
    lens_a = np.array(lens, dtype=np.int64)
    kernel(q, k, v, rows, tables, lens_a, 0.3, out, threads, window, softcap, k_scale, v_scale)
    return out


@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
@pytest.mark.parametrize("block_size", [1, 16])
# Every way head_dots8 groups query heads: (8, 8) one KV head each, (16, 8) runs of two, (8, 2)
# of four, (16, 1) all eight of a pass; (12, 4) runs of three and (6, 1) fewer than eight
# heads take the per-head path.
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (16, 8), (8, 2), (16, 1), (12, 4), (6, 1)])
# 20 and 136: whole vectors and a tail below the vector width; 16 one vector.
@pytest.mark.parametrize("head_dim", [16, 20, 136])
def test_kernel_equals_reference(
    kernel: native.PagedDecode,
    dtype: torch.dtype,
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    lens = [1, block_size, block_size + 1, 37, 130, 2, 77]
    pools, tables = _quantized_pool(lens, block_size, kv_heads, head_dim, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    # q as transformers hands it over: [1, heads, T, D] viewed as [T, heads, D] (not contiguous).
    q = torch.randn(1, heads, len(lens), head_dim, generator=gen)[0].transpose(0, 1)
    expected = _reference(q, pools, tables, lens)
    got = _attend(kernel, q, pools, tables, lens)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 33])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_window_and_softcap_equal_reference(
    kernel: native.PagedDecode,
    dtype: torch.dtype,
    block_size: int,
    window: int | None,
    softcap: float | None,
) -> None:
    lens = [1, 4, 16, 17, 40, 130, 33, 34]
    pools, tables = _quantized_pool(lens, block_size, 2, 32, dtype, seed=5)
    k_scale, v_scale = pools[2:]
    poisoned = tables
    if window is not None:
        # Released blocks (wholly before the window) point at a block whose scales are NaN:
        # never read, so the output stays finite and equal to the reference on intact tables.
        poisoned = tables.copy()
        spare = k_scale.shape[0] - 1  # in no table
        k_scale[spare], v_scale[spare] = float("nan"), float("nan")
        for i, n in enumerate(lens):
            poisoned[i, : max(0, n - window) // block_size] = spare
    q = torch.randn(len(lens), 8, 32, generator=torch.Generator().manual_seed(6)) * 3
    got = _attend(kernel, q, pools, poisoned, lens, 1, window, softcap)
    assert torch.isfinite(got).all()
    expected = _reference(q, pools, tables, lens, window, softcap)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
def test_each_sequence_is_independent_of_batch_and_threads(
    kernel: native.PagedDecode, dtype: torch.dtype
) -> None:
    lens = [300, 17, 64, 129, 5, 250]
    pools, tables = _quantized_pool(lens, 16, 2, 64, dtype, seed=3)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(4))
    batch = _attend(kernel, q, pools, tables, lens)
    assert torch.equal(_attend(kernel, q, pools, tables, lens, 2), batch)
    for i in range(len(lens)):
        alone = _attend(kernel, q[i : i + 1], pools, tables[i : i + 1].copy(), lens[i : i + 1])
        assert torch.equal(alone[0], batch[i]), f"sequence {i} changed with its batch"


@pytest.fixture(params=[False, True], ids=["default", "denormals-are-zero"])
def flush_denormal(request: pytest.FixtureRequest) -> Iterator[None]:
    """The calling thread (where a one-thread kernel call runs) with or without DAZ/FTZ."""
    if request.param and not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no denormals-are-zero mode")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
@pytest.mark.parametrize("build_name", ["engine", "portable"])
def test_every_code_reads_back_exactly(
    kernel: native.PagedDecode,
    portable: native.PagedDecode,
    flush_denormal: None,
    dtype: torch.dtype,
    build_name: str,
) -> None:
    """One visible token with V scale 1: its softmax weight is exactly 1, so the output is the
    V row as the kernel reads it. The row holds every code twice (head_dim 2 x codes + 5:
    vector loads and the scalar tail both meet each one)."""
    use = kernel if build_name == "engine" else portable
    codes = _codes(dtype).view(torch.uint8)  # (torch has no flip or cat for fp8)
    row = torch.cat([codes, codes.flip(0), codes[:5]]).view(dtype)
    head_dim = len(row)
    v = row.view(1, 1, 1, head_dim).clone()
    k = torch.zeros_like(v)
    ones = torch.ones(1, 1, 1)
    q = torch.randn(1, 2, head_dim)
    tables = np.zeros((1, 1), dtype=np.int32)
    got = _attend(use, q, (k, v, ones, ones.clone()), tables, [1])
    want = row.float().expand(2, head_dim)
    assert torch.equal(got[0], want), (got[0] != want).nonzero()[:8]


def _rows(d: int) -> torch.Tensor:
    """Rows that exercise the write rule: zeros, huge and tiny magnitudes (float32's largest,
    denormals), single outliers, signed zeros, and random rows over 24 decades."""
    gen = torch.Generator().manual_seed(7)
    rows = [
        torch.zeros(d),
        -torch.zeros(d),
        torch.full((d,), 3.0e38),
        torch.linspace(-3.4e38, 3.4e38, d),
        torch.full((d,), 1e-40),  # denormal
        torch.linspace(-1e-44, 1e-44, d),
        torch.linspace(-1e-30, 1e-30, d),
        torch.cat([torch.tensor([1e30]), torch.randn(d - 1, generator=gen)]),
        torch.cat([torch.tensor([-1e-30]), torch.full((d - 1,), 1e-38)]),
    ]
    magnitude = 10.0 ** (torch.rand(200, 1, generator=gen) * 24 - 12)
    rows += list(torch.randn(200, d, generator=gen) * magnitude)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
@pytest.mark.parametrize("fixed", [None, 1e-3, 0.37, 12.5])
@pytest.mark.parametrize("d", [7, 64, 128])
def test_quantizer_is_kv_quant_byte_for_byte(
    quantizer: native.KvQuantize, dtype: torch.dtype, fixed: float | None, d: int
) -> None:
    x = _rows(d)
    data, scales = quantizer(x, dtype, fixed)
    want_data, want_scales = quantize(x, dtype, fixed)
    assert torch.equal(scales, want_scales)
    differ = data.view(torch.uint8) != want_data.view(torch.uint8)
    assert not differ.any(), (x[differ][:4], data[differ][:4], want_data[differ][:4])


def _rounding_points(dtype: torch.dtype) -> torch.Tensor:
    """Every finite float32 whose low 8 bits are zero (every sign, exponent and 15 leading
    mantissa bits), and each midpoint between two neighbouring values of ``dtype`` with the
    floats just below and above it: where a round-to-nearest-even can go wrong."""
    bits = torch.arange(1 << 24, dtype=torch.int64).mul_(256).to(torch.int32)
    grid = bits.view(torch.float32)
    grid = grid[torch.isfinite(grid)]
    values = _codes(dtype).float().unique()  # sorted
    mid = (values[:-1].double() + values[1:].double()) / 2  # exact: few mantissa bits each
    mid = mid.float()
    around = [mid, torch.nextafter(mid, mid - 1), torch.nextafter(mid, mid + 1)]
    edge = torch.tensor([QMAX[dtype], -QMAX[dtype]])
    beyond = [torch.nextafter(edge, edge * 2), edge * 1.5, torch.tensor([math.inf, -math.inf])]
    return torch.cat([grid, *around, edge, *beyond])


@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
def test_conversion_rounds_as_torch_on_every_rounding_point(
    quantizer: native.KvQuantize, dtype: torch.dtype
) -> None:
    """Fixed scale 1: each element is only clamped and converted (x / 1 is x), so this holds
    the C rounding (int8 half to even, fp8 to nearest even, subnormals included) to torch's
    ``torch.round`` and ``.to(float8_*)`` on 16.8 M floats."""
    x = _rounding_points(dtype)
    x = torch.cat([x, x.new_zeros(-len(x) % 256)]).view(-1, 256)
    data, _ = quantizer(x, dtype, 1.0)
    want, _ = quantize(x, dtype, 1.0)
    differ = data.view(torch.uint8) != want.view(torch.uint8)
    assert not differ.any(), (x[differ][:8], data[differ][:8], want[differ][:8])


# --- the native decode step on 8-bit pools -------------------------------------------------


def _llm(model_dir: Path, dtype: torch.dtype) -> LLM:
    # No prefix cache: the second run of the prompts schedules exactly the first run's steps.
    return LLM(
        str(model_dir), device="cpu", block_size=16, num_blocks=64, enable_prefix_caching=False,
        kv_cache_dtype=NAMES[dtype],
    )  # fmt: skip


def _generate(llm: LLM, max_tokens: int = 30) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params)]


def _assert_close(native_logits: torch.Tensor, module_logits: torch.Tensor, step: int) -> None:
    scale = float(module_logits.abs().max())
    err = float((native_logits - module_logits).abs().max())
    assert err <= STEP_REL_TOL * scale, f"step {step}: logits differ by {err:.2e} ({scale})"


def _ordinal(codes: torch.Tensor) -> torch.Tensor:
    """Each 8-bit code's rank among its format's values (neighbours differ by 1): int8 its
    value; fp8 its magnitude bits, negated for a negative sign (both zeros rank 0)."""
    if codes.dtype is torch.int8:
        return codes.int()
    raw = codes.view(torch.uint8).int()
    magnitude = raw & 0x7F
    return torch.where(raw >= 0x80, -magnitude, magnitude)


def _with_fixed_scales(path: Path, layers: int) -> Path:
    """The checkpoint at ``path`` with llm-compressor's per-layer ``k_scale`` / ``v_scale``."""
    scales = {}
    for i in range(layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.011 * (i + 1))
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.007 * (i + 1))
    save_file(scales, str(path / "kv_scales.safetensors"))
    return path


@pytest.mark.parametrize(
    ("dtype", "fixed"),
    [(torch.int8, False), (torch.float8_e4m3fn, False), (torch.float8_e5m2, False),
     (torch.float8_e4m3fn, True), (torch.float8_e5m2, True)],
    ids=["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3-fixed", "fp8_e5m2-fixed"],
)  # fmt: skip
def test_decode_steps_match_the_module_path(
    dtype: torch.dtype, fixed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy generation with the native decoder on, then off: the same tokens, logits equal
    to STEP_REL_TOL. Then each native step again from the pools it started from, through the
    module path: the same bytes and scales written (see the module docstring for the bound)."""
    require_native_kernels()
    path = build("llama", tmp_path / "llama")
    if fixed:
        _with_fixed_scales(path, 2)
    llm = _llm(path, dtype)
    runner = llm.engine.runner
    stack = runner.decoder
    assert stack is not None and runner.native_decode is not None
    assert stack.kv_dtype is dtype and runner.k_caches[0].dtype is dtype
    assert (stack.fixed is not None) is fixed
    steps: list[tuple[StepPlan, list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = []
    run = ModelRunner.run

    def recording(self: ModelRunner, plan: StepPlan) -> torch.Tensor:
        before = [t.clone() for t in self.device_pools]
        logits = run(self, plan)
        steps.append((plan, before, [t.clone() for t in self.device_pools], logits))
        return logits

    monkeypatch.setattr(ModelRunner, "run", recording)
    rec = _Recorder(runner, monkeypatch)
    native_tokens = _generate(llm)
    assert rec.native_steps >= 29, rec.native_steps
    native_steps = steps[-rec.native_steps :]  # the steps after the prompts' prefill
    native_logits = list(rec.logits)
    rec.logits.clear()
    runner.decoder = None  # the module path for every step
    assert _generate(llm) == native_tokens
    _assert_tie_free(rec.logits)
    for step, (a, b) in enumerate(zip(native_logits, rec.logits, strict=True)):
        _assert_close(a, b, step)
    # Each native step replayed from its starting pools through the module path.
    written = differ = 0
    for step, (plan, before, after, logits) in enumerate(native_steps):
        for pool, saved in zip(runner.device_pools, before, strict=True):
            pool.copy_(saved)
        _assert_close(logits, run(runner, plan), step)
        pools = runner.device_pools
        layers = len(runner.k_caches)
        for i, (mine, theirs) in enumerate(zip(after, pools, strict=True)):
            if i < 2 * layers:  # data: the same codes, or neighbouring ones
                apart = (_ordinal(mine) - _ordinal(theirs)).abs()
                assert int(apart.max()) <= 1, f"step {step}: codes apart by {int(apart.max())}"
                differ += int((apart > 0).sum())
                written += len(plan.inputs.slots) * mine[0, 0].numel()
            else:  # scales: equal to rounding (the K/V they come from differ by rounding)
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=0)
    assert differ <= written / 1000, (differ, written)
    if fixed:  # every written scale is the layer's fixed one
        for i, scale in enumerate(runner.k_scales):
            assert scale[scale != 0].unique().tolist() == [float(np.float32(0.011 * (i + 1)))]
