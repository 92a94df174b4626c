"""The native CPU decode kernel (``cpu/native.py``, ``cpu/csrc/paged_decode.c``).

It must compute what ``paged_attention_reference`` computes for one-token queries, to rounding
(another summation order: held to 1e-5 on O(1) outputs from unit-normal data, where fp32
rounding differences are ~1e-7), for every block size, grouped-query layout and head size; give a
sequence the same bits whatever batch or thread count it runs in; refuse indices outside the
pool with an exception rather than a crash; and fall back to the torch path, with a warning,
when no compiler can build it. The HF equivalence suite (``test_llm_equivalence.py``) runs on
this kernel too: on CPU with fp32 pools every engine uses it (checked below).

In CI the kernel must build (the README's test command installs nothing that could lack a
compiler: Triton needs one too); elsewhere its tests skip with a reason when no compiler exists.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from quire_engine.cpu import native
from quire_engine.cpu.paged_attention import CpuAttentionPlan
from quire_engine.kernels.kv_cache_ops import write_kv_reference
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import paged_attention_reference

ATOL = RTOL = 1e-5


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty kernel cache and a loader that has not run yet; the process-wide loader is
    restored afterwards so other tests see the normal kernel."""
    monkeypatch.setenv("QUIRE_KERNEL_CACHE", str(tmp_path / "kernels"))
    native.reset()
    yield tmp_path / "kernels"
    native.reset()


def _pool(
    lens: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Shuffled blocks for ``lens``: K/V pools [num_blocks, bs, kv_heads, D] and int32 tables."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3  # a few blocks nobody uses
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = np.zeros((len(lens), max(need)), dtype=np.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), tables


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: np.ndarray,
    lens: list[int],
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    n = len(lens)
    inputs = PagedAttentionInputs(
        q, k, v, torch.from_numpy(tables), torch.tensor(lens, dtype=torch.int32),
        torch.arange(n + 1, dtype=torch.int32), 0.3, max_query_len=1, max_seq_len=max(lens),
        sliding_window=window, softcap=softcap,
    )  # fmt: skip
    return paged_attention_reference(inputs, finite_cache=True)


@pytest.mark.parametrize("block_size", [1, 4, 16])
# (12, 4): eight query heads at once, then four one by one past them.
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1), (12, 4)])
# 20: two vectors and a tail below the vector width; the others whole vectors (2 to 17).
@pytest.mark.parametrize("head_dim", [16, 20, 64, 80, 136])
def test_kernel_equals_reference(
    kernel: native.PagedDecode, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    # Ragged contexts: a single token, exact multiples of the block, one past, long ones.
    lens = [1, block_size, block_size + 1, 37, 130, 3 * block_size, 2, 77]
    k, v, tables = _pool(lens, block_size, kv_heads, head_dim)
    gen = torch.Generator().manual_seed(1)
    # q as transformers hands it over: [1, heads, T, D] viewed as [T, heads, D] (not contiguous).
    q = torch.randn(1, heads, len(lens), head_dim, generator=gen)[0].transpose(0, 1)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    rows = np.arange(len(lens), dtype=np.int64)
    kernel(q, k, v, rows, tables, np.array(lens, dtype=np.int64), 0.3, out)
    expected = _reference(q, k, v, tables, lens)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 33])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_window_and_softcap_equal_reference(
    kernel: native.PagedDecode, block_size: int, window: int | None, softcap: float | None
) -> None:
    lens = [1, 4, 16, 17, 40, 130, 33, 34]
    heads, kv_heads, head_dim = 8, 2, 32
    k, v, tables = _pool(lens, block_size, kv_heads, head_dim, seed=5)
    if window is not None:
        # What a windowed model does to blocks wholly before the window: releases them (their
        # entries then name block 0). Point them at a block of NaN instead: never read, so the
        # output stays finite and equal to the reference on the intact table.
        poisoned = tables.copy()
        spare = min(set(range(k.shape[0])) - set(tables.flatten().tolist()))  # in no table
        k[spare], v[spare] = float("nan"), float("nan")
        for i, n in enumerate(lens):
            poisoned[i, : max(0, n - window) // block_size] = spare
    else:
        poisoned = tables
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(6)) * 3
    out = torch.empty_like(q)
    rows = np.arange(len(lens), dtype=np.int64)
    lens_a = np.array(lens, dtype=np.int64)
    kernel(q, k, v, rows, poisoned, lens_a, 0.3, out, sliding_window=window, softcap=softcap)
    expected = _reference(q, k, v, tables, lens, window, softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_each_sequence_is_independent_of_batch_and_threads(kernel: native.PagedDecode) -> None:
    lens = [300, 17, 64, 129, 5, 250]
    k, v, tables = _pool(lens, 16, 2, 64)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(2))
    lens_a = np.array(lens, dtype=np.int64)
    batch = torch.zeros_like(q)
    kernel(q, k, v, np.arange(len(lens), dtype=np.int64), tables, lens_a, 0.125, batch)
    for threads in (1, 2):
        again = torch.zeros_like(q)
        kernel(q, k, v, np.arange(len(lens), dtype=np.int64), tables, lens_a, 0.125, again, threads)
        assert torch.equal(again, batch)
    for i in range(len(lens)):
        alone = torch.zeros_like(q)
        rows = np.array([i], dtype=np.int64)
        kernel(q, k, v, rows, tables[i : i + 1].copy(), lens_a[i : i + 1], 0.125, alone)
        assert torch.equal(alone[i], batch[i]), f"sequence {i} changed with its batch"
        assert not alone[np.arange(len(lens)) != i].any(), "rows outside `rows` were written"


def _mixed_step(block_size: int) -> dict[str, np.ndarray | int]:
    # (context after the step, new tokens): decode, a fresh prompt, a prompt after a prefix.
    seqs = [(37, 1), (5, 1), (9, 9), (64, 1), (50, 7), (1, 1)]
    need = [-(-n // block_size) for n, _ in seqs]
    perm = np.random.default_rng(3).permutation(sum(need) + 2)
    tables = np.zeros((len(seqs), max(need)), dtype=np.int32)
    slots, used = [], 0
    for i, ((length, n), nb) in enumerate(zip(seqs, need, strict=True)):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        slots += [tables[i, p // block_size] * block_size + p % block_size
                  for p in range(length - n, length)]  # fmt: skip
    counts = [n for _, n in seqs]
    return {
        "slots": np.array(slots, dtype=np.int64),
        "block_tables": tables,
        "seq_lens": np.array([length for length, _ in seqs], dtype=np.int64),
        "query_start_loc": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        "block_size": block_size,
        "num_blocks": len(perm),
    }


def test_plan_with_native_decode_equals_torch_plan(kernel: native.PagedDecode) -> None:
    step = _mixed_step(4)
    num_blocks = int(step.pop("num_blocks"))
    heads, kv_heads, head_dim = 8, 2, 32
    gen = torch.Generator().manual_seed(4)
    num_tokens = len(step["slots"])  # type: ignore[arg-type]
    k = torch.randn(num_blocks, 4, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, 4, kv_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    write_kv_reference(key, value, k, v, torch.from_numpy(step["slots"]))
    common = {**step, "num_kv_heads": kv_heads, "head_dim": head_dim}
    torch_plan = CpuAttentionPlan.build(**common)  # type: ignore[arg-type]
    native_plan = CpuAttentionPlan.build(**common, native=kernel)  # type: ignore[arg-type]
    assert native_plan.decode == [] and native_plan.native is not None
    assert native_plan.native.rows.tolist() == [0, 1, 11, 19]  # the one-token rows
    expected = torch_plan.attend(q, k, v, 0.25)
    got = native_plan.attend(q, k, v, 0.25)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    prefill_rows = [r for r in range(num_tokens) if r not in (0, 1, 11, 19)]
    assert torch.equal(got[prefill_rows], expected[prefill_rows])  # the same torch code


def test_plan_takes_windowed_layers_only_in_pure_decode_steps(kernel: native.PagedDecode) -> None:
    mixed = _mixed_step(4)
    mixed.pop("num_blocks")
    common = {"num_kv_heads": 1, "head_dim": 8}
    plans = {
        "mixed native": CpuAttentionPlan.build(**mixed, **common, native=kernel),  # type: ignore[arg-type]
        "mixed torch": CpuAttentionPlan.build(**mixed, **common),  # type: ignore[arg-type]
    }
    decode_only = {
        "slots": np.array([3, 9], dtype=np.int64),
        "block_tables": np.array([[0, 2], [1, 2]], dtype=np.int32),
        "seq_lens": np.array([4, 6], dtype=np.int64),
        "query_start_loc": np.array([0, 1, 2], dtype=np.int64),
        "block_size": 4,
    }
    plans["decode native"] = CpuAttentionPlan.build(**decode_only, **common, native=kernel)  # type: ignore[arg-type]
    plans["decode torch"] = CpuAttentionPlan.build(**decode_only, **common)  # type: ignore[arg-type]
    windowed = {name: plan.handles(8, None) for name, plan in plans.items()}
    capped = {name: plan.handles(None, 30.0) for name, plan in plans.items()}
    expected = {"mixed native": False, "mixed torch": False, "decode native": True}
    assert windowed == capped == {**expected, "decode torch": False}
    assert all(plan.handles(None, None) for plan in plans.values())
    pool = torch.zeros(3, 4, 1, 8)
    with pytest.raises(ValueError, match="no sliding window or soft-cap"):
        plans["mixed native"].attend(torch.zeros(20, 1, 8), pool, pool.clone(), 1.0, 8)


def test_plan_refuses_indices_outside_the_pool(kernel: native.PagedDecode) -> None:
    step = _mixed_step(4)
    num_blocks = int(step.pop("num_blocks"))
    common = {**step, "num_kv_heads": 1, "head_dim": 8, "native": kernel}
    plan = CpuAttentionPlan.build(**common)  # type: ignore[arg-type]
    small = torch.zeros(num_blocks - 3, 4, 1, 8)  # too small for the tables' block ids
    q = torch.zeros(len(step["slots"]), 1, 8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside a pool"):
        plan.attend(q, small, small.clone(), 1.0)
    long = {**common, "seq_lens": step["seq_lens"] * 100}
    with pytest.raises(ValueError, match="outside their block tables"):
        CpuAttentionPlan.build(**long)  # type: ignore[arg-type]
    pool = torch.zeros(num_blocks, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp32"):
        plan.attend(q.double(), pool, pool.clone(), 1.0)


def test_engine_runner_uses_the_kernel_on_cpu_fp32(kernel: native.PagedDecode) -> None:
    from quire_engine import LLM, SamplingParams

    llm = LLM(device="cpu", num_blocks=64, max_model_len=64)
    assert llm.engine.runner.native_decode is kernel
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_build_once_then_load_from_cache(
    kernel: native.PagedDecode, fresh_loader: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=native.__name__)
    first = native.paged_decode()
    assert first is not None and first.path.parent == fresh_loader
    built = sorted(fresh_loader.iterdir())
    assert built == [first.path], "one shared object, no temporary files left behind"
    stamp = first.path.stat().st_mtime_ns
    native.reset()
    second = native.paged_decode()
    assert second is not None and second.path == first.path
    assert first.path.stat().st_mtime_ns == stamp, "a cached build must not be rebuilt"


def test_no_compiler_falls_back_with_a_warning(
    fresh_loader: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.paged_decode() is None
    assert "no C compiler" in caplog.text
    assert not fresh_loader.exists() or not any(fresh_loader.iterdir())


@pytest.mark.slow  # ~17 s
def test_failed_build_falls_back_with_the_compilers_message(
    kernel: native.PagedDecode,
    fresh_loader: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("int quire_paged_decode(void) { return this_is_not_c; }\n")
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES, broken))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.paged_decode() is None
    assert "this_is_not_c" in caplog.text and "torch paths" in caplog.text
    assert native.skinny_linear() is None
    assert not any(fresh_loader.iterdir()), "a failed build leaves nothing in the cache"


def test_turned_off_by_environment(fresh_loader: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUIRE_NATIVE_KERNELS", "0")
    assert native.paged_decode() is None
    assert native.skinny_linear() is None
