"""A bf16 model's KV pool in the native CPU decode kernel (``csrc/paged_decode.c``, kind
``QUIRE_KV_BF16``) and the CPU attention plan that calls it.

A bfloat16 element widens to float32 exactly (it is a float's high half), so the kernel on a
bf16 pool must compute what ``paged_attention_reference`` computes on the same pool widened to
float32, to float32 rounding (1e-5 on O(1) outputs, as the float32 kernel's tests), for every
grouped-query layout, head size with and without a tail below the vector width, block size,
sliding window and soft-cap; and a sequence's row must be the same bits whatever the batch.
The plan takes bf16 queries (widened for the kernel, the output rounded once to bf16): it
must equal the torch path's plan to one bf16 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from quire_engine.cpu import native
from quire_engine.cpu.paged_attention import CpuAttentionPlan
from tests.engine_tests.cpu.test_native_kernels import _pool, _reference

ATOL = RTOL = 1e-5
# Two bf16 results of the same attention computed in different orders: each rounded once to
# bf16 (8 mantissa bits, relative step 2^-8), so they may differ by one bf16 step.
BF16_STEP = 2.0**-7


def _bf16_pool(
    lens: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    k, v, tables = _pool(lens, block_size, kv_heads, head_dim, seed)
    return k.bfloat16(), v.bfloat16(), tables


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1), (12, 4), (16, 1)])
@pytest.mark.parametrize("head_dim", [16, 20, 64, 136])
def test_kernel_on_a_bf16_pool_equals_reference(
    kernel: native.PagedDecode, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    lens = [1, block_size, block_size + 1, 37, 130, 2, 77]
    k, v, tables = _bf16_pool(lens, block_size, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    out = torch.full_like(q, float("nan"))
    rows = np.arange(len(lens), dtype=np.int64)
    kernel(q, k, v, rows, tables, np.array(lens, dtype=np.int64), 0.3, out)
    expected = _reference(q, k.float(), v.float(), tables, lens)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [None, 5, 33])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_bf16_window_and_softcap_equal_reference(
    kernel: native.PagedDecode, window: int | None, softcap: float | None
) -> None:
    lens = [1, 4, 16, 17, 40, 130, 33]
    k, v, tables = _bf16_pool(lens, 16, 2, 32, seed=5)
    q = torch.randn(len(lens), 8, 32, generator=torch.Generator().manual_seed(6)) * 3
    out = torch.empty_like(q)
    rows = np.arange(len(lens), dtype=np.int64)
    lens_a = np.array(lens, dtype=np.int64)
    kernel(q, k, v, rows, tables, lens_a, 0.3, out, sliding_window=window, softcap=softcap)
    expected = _reference(q, k.float(), v.float(), tables, lens, window, softcap)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_bf16_rows_are_independent_of_the_batch(kernel: native.PagedDecode) -> None:
    lens = [300, 17, 64, 129, 5]
    k, v, tables = _bf16_pool(lens, 16, 2, 64)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(2))
    lens_a = np.array(lens, dtype=np.int64)
    batch = torch.zeros_like(q)
    kernel(q, k, v, np.arange(len(lens), dtype=np.int64), tables, lens_a, 0.125, batch, 2)
    for i in range(len(lens)):
        alone = torch.zeros_like(q)
        rows = np.array([i], dtype=np.int64)
        kernel(q, k, v, rows, tables[i : i + 1].copy(), lens_a[i : i + 1], 0.125, alone)
        assert torch.equal(alone[i], batch[i]), f"sequence {i} changed with its batch"


def test_kernel_refuses_scales_with_a_bf16_pool(kernel: native.PagedDecode) -> None:
    k, v, tables = _bf16_pool([3], 4, 1, 16)
    q = torch.randn(1, 1, 16)
    scales = torch.ones(k.shape[:3])
    with pytest.raises(ValueError, match="scales belong to 8-bit pools"):
        kernel(
            q, k, v, np.zeros(1, np.int64), tables, np.array([3]), 0.3, torch.empty_like(q),
            k_scale=scales, v_scale=scales,
        )  # fmt: skip


def test_plan_with_bf16_queries_equals_the_torch_plan(kernel: native.PagedDecode) -> None:
    """A bf16 model's decode step: queries, pool and output bf16; the native plan (queries
    widened, fp32 sums, one rounding) against the torch plan (SDPA over the gathered blocks)."""
    lens = [40, 1, 17, 100]
    block_size, heads, kv_heads, head_dim = 16, 8, 2, 64
    k, v, tables = _bf16_pool(lens, block_size, kv_heads, head_dim, seed=3)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(4))
    q = q.bfloat16()
    n = len(lens)
    inputs: dict[str, Any] = {
        "slots": np.zeros(n, dtype=np.int64),  # unused: no K/V written here
        "block_tables": tables,
        "seq_lens": np.array(lens, dtype=np.int64),
        "query_start_loc": np.arange(n + 1, dtype=np.int64),
        "block_size": block_size,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
    }
    native_out = CpuAttentionPlan.build(**inputs, native=kernel).attend(q, k, v, 0.125)
    torch_out = CpuAttentionPlan.build(**inputs).attend(q, k, v, 0.125)
    assert native_out.dtype == torch.bfloat16
    scale = torch_out.float().abs().clamp(min=1.0)
    assert ((native_out.float() - torch_out.float()).abs() / scale).max() <= BF16_STEP
