"""The 8-bit KV format (``kernels.kv_quant``) and its torch paths: the quantization rule, the
write into a pool with its scales, the reference attention over 8-bit pools against attention
over the dequantized values, and block copies/swaps carrying scales with the bytes."""

from __future__ import annotations

import pytest
import torch

from quire_engine.kernels.kv_cache_ops import copy_blocks, swap_blocks, write_kv
from quire_engine.kernels.kv_quant import QMAX, QUANTIZED_DTYPES, dequantize, quantize
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import paged_attention_reference

FORMATS = pytest.mark.parametrize("dtype", QUANTIZED_DTYPES, ids=lambda d: str(d)[6:])
# Worst relative error of one element against its row's amax: half a step of the format at the
# top of its range (int8: 0.5 / 127; e4m3: 3 mantissa bits, 2^-4; e5m2: 2 bits, 2^-3).
ROW_ERROR = {torch.int8: 0.5 / 127, torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


@FORMATS
def test_dynamic_scales_use_the_whole_range_and_round_trip_within_half_a_step(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 3, 64)[:, None, None]  # [T, heads, D]
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (64, 4)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale, amax / QMAX[dtype])
    # The largest element of every row lands on the format's largest value, never past it.
    assert torch.equal(q.float().abs().amax(-1), torch.full_like(amax, QMAX[dtype]))
    error = (dequantize(q, scale) - x).abs().amax(-1) / amax
    assert float(error.max()) <= ROW_ERROR[dtype] * (1 + 1e-6)


@FORMATS
def test_zero_rows_read_back_as_zeros_and_never_divide_by_zero(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 2, 8)
    x[1, 0, 3] = -2.5
    q, scale = quantize(x, dtype)
    assert torch.isfinite(scale).all() and bool((scale > 0).all())
    back = dequantize(q, scale)
    assert torch.equal(back[0], torch.zeros(2, 8))
    assert float(back[1, 0, 3]) == -2.5  # the amax element is exact


def test_fixed_scales_saturate_instead_of_overflowing() -> None:
    x = torch.tensor([[[1.0, -1e6, 3.0, 1e-3]]])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, scale = quantize(x, dtype, fixed=0.5)
        assert torch.equal(scale, torch.tensor([[0.5]]))
        back = dequantize(q, scale)
        assert torch.isfinite(back).all()
        assert float(back[0, 0, 1]) == -QMAX[dtype] * 0.5  # saturated, not inf or NaN
        assert float(back[0, 0, 0]) == 1.0 and float(back[0, 0, 2]) == 3.0
    with pytest.raises(ValueError, match="positive and finite"):
        quantize(x, torch.int8, fixed=0.0)
    with pytest.raises(ValueError, match="not an 8-bit"):
        quantize(x, torch.float16)


def test_int8_rounds_half_to_even() -> None:
    # amax 127 makes the scale exactly 1: the elements are the quantizer's inputs.
    x = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]]])
    q, _ = quantize(x, torch.int8)
    assert q.tolist() == [[[127, 0, 2, 2, 0, -2]]]


Pair = tuple[torch.Tensor, torch.Tensor]


def _pools(
    dtype: torch.dtype, blocks: int = 6, block_size: int = 4, heads: int = 2, dim: int = 8
) -> tuple[Pair, Pair]:
    """(K and V data pools of ``dtype``, their float32 scale pools), zeroed."""
    shape = (blocks, block_size, heads, dim)
    zeros = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    scales = (torch.zeros(shape[:3]), torch.zeros(shape[:3]))
    return zeros, scales


@FORMATS
def test_write_kv_quantizes_into_the_slots_and_their_scales(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    (k_cache, v_cache), (k_scale, v_scale) = _pools(dtype)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8) * 10
    slots = torch.tensor([0, 5, 6, 13, 23])
    write_kv(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        want_q, want_s = quantize(x, dtype)
        flat_q, flat_s = cache.view(-1, 2, 8), scales.view(-1, 2)
        assert torch.equal(flat_q[slots].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(flat_s[slots], want_s)
        untouched = torch.ones(flat_s.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert not flat_s[untouched].any() and not flat_q[untouched].float().any()


def test_write_kv_refuses_a_half_described_8bit_cache() -> None:
    (k_cache, v_cache), (k_scale, _) = _pools(torch.int8)
    key = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="needs float32 k_scale and v_scale"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0]), k_scale=k_scale)
    with pytest.raises(ValueError, match="scales belong to 8-bit caches"):
        fp32 = torch.zeros(6, 4, 2, 8)
        write_kv(key, key, fp32, fp32.clone(), torch.tensor([0]), k_scale=k_scale, v_scale=k_scale)


@FORMATS
def test_reference_attention_reads_8bit_pools_as_their_dequantized_values(
    dtype: torch.dtype,
) -> None:
    """Attention over an 8-bit pool equals attention over a float32 pool holding exactly the
    dequantized values (what the kernels must compute): prefill with a cached prefix, decode,
    a window and a soft-cap."""
    torch.manual_seed(2)
    (k_cache, v_cache), (k_scale, v_scale) = _pools(dtype, blocks=8, block_size=4, heads=2, dim=8)
    lens = [13, 6]  # sequence 0: 3 queries after a 10-token prefix; sequence 1: decode
    tables = torch.tensor([[3, 0, 6, 1], [5, 2, 0, 0]], dtype=torch.int32)
    slots = torch.cat(
        [
            tables[s, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
            for s, n in enumerate(lens)
        ]
    )
    key, value = torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)
    write_kv(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    k_float, v_float = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    q = torch.randn(4, 4, 8)  # 3 queries of sequence 0, 1 of sequence 1; 4 heads over 2 KV heads
    common = (
        torch.tensor(lens, dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32), 0.35,
        3, 13,
    )  # fmt: skip
    for window, cap in ((None, None), (5, None), (None, 2.0)):
        got = paged_attention_reference(
            PagedAttentionInputs(
                q, k_cache, v_cache, tables, *common, window, cap, k_scale, v_scale
            )
        )
        want = paged_attention_reference(
            PagedAttentionInputs(q, k_float, v_float, tables, *common, window, cap)
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@FORMATS
def test_block_copies_and_swaps_carry_each_blocks_scales(dtype: torch.dtype) -> None:
    """The runner moves scale pools in the same calls as data pools: after a copy-on-write copy
    and a swap out and back, each destination block holds its source's bytes and scales."""
    torch.manual_seed(3)
    (k_cache, v_cache), (k_scale, v_scale) = _pools(dtype)
    slots = torch.arange(24)
    write_kv(
        torch.randn(24, 2, 8), torch.randn(24, 2, 8), k_cache, v_cache, slots,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    device = [k_cache, v_cache, k_scale, v_scale]
    before = [t.clone() for t in device]
    copy_blocks([k_cache, k_scale], [v_cache, v_scale], [(1, 4), (2, 5)])
    for old, new in zip(before, device, strict=True):
        assert torch.equal(new[4].view(torch.uint8), old[1].view(torch.uint8))
        assert torch.equal(new[5].view(torch.uint8), old[2].view(torch.uint8))
        assert torch.equal(new[:4].view(torch.uint8), old[:4].view(torch.uint8))
    host = [torch.zeros((3, *t.shape[1:]), dtype=t.dtype) for t in device]
    swap_blocks(device, host, [(0, 2), (3, 0)])
    swapped = [t.clone() for t in device]
    swap_blocks(host, device, [(2, 5), (0, 1)])
    for old, new in zip(swapped, device, strict=True):
        assert torch.equal(new[5].view(torch.uint8), old[0].view(torch.uint8))
        assert torch.equal(new[1].view(torch.uint8), old[3].view(torch.uint8))
