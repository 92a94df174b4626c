"""Kernels: the Triton paged-attention and KV-write kernels against their torch references, the
references against plain contiguous attention, block copies/swaps, and input validation.

The Triton kernels run on CPU in Triton's interpreter, and in triton 3.x ``TRITON_INTERPRET=1``
only takes effect if it is set before triton is imported: ``triton.jit`` chooses compiled or
interpreted when it wraps a function, and triton wraps its own helpers (``tl.max``, ``tl.sum``)
at import. Setting the variable from a test (``monkeypatch.setenv``) is too late once anything in
the session has imported triton, and a conftest would force the interpreter on every test of the
directory, GPU runs included. So the ``test_interpreted_*`` tests run for real only in a process
that started in interpreter mode; in an ordinary session they skip and
``test_triton_interpreter_suite`` runs them in a child pytest with the variable set from the
start (one extra interpreter start-up, a few seconds). With ``TRITON_INTERPRET=1`` exported
before pytest starts they run in-process and the child is skipped.

GPU tests carry ``@pytest.mark.gpu`` and skip without CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from quire_engine.bench import kernel as kernel_bench
from quire_engine.kernels import paged_attention_reference as reference_module
from quire_engine.kernels.kv_cache_ops import (
    _write_config,
    _write_kv_kernel,
    copy_blocks,
    swap_blocks,
    write_kv,
    write_kv_triton,
)
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import paged_attention_reference
from quire_engine.kernels.paged_attention_triton import (
    _merge_config,
    _merge_splits_kernel,
    _paged_attention_kernel,
    _stage1_config,
    choose_num_splits,
    paged_attention,
)
from quire_engine.kernels.triton_runtime import HAS_TRITON, INTERPRETED, triton_usable

gpu = pytest.mark.gpu  # skipped without CUDA by the root conftest's hook


def _interpreter_live() -> bool:
    """Whether this process imported triton in interpreter mode (kernels and triton's helpers)."""
    if not INTERPRETED:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


LIVE = _interpreter_live()


@pytest.fixture
def interpret() -> None:
    """Tests that launch Triton kernels on CPU: they run where the interpreter is live."""
    if not LIVE:
        pytest.skip("run by test_triton_interpreter_suite in a child process")


def run_interpreter_suite(test_file: str) -> None:
    """Run ``test_file``'s ``test_interpreted_*`` tests in a child pytest that starts with
    TRITON_INTERPRET=1 (see the module docstring), failing with its output if any fails or
    skips."""
    if LIVE:
        pytest.skip("the interpreter is live in this process: the tests ran here")
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-k", "interpreted",
         "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1:] if result.stdout.strip() else []
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert summary and " passed" in summary[0] and "skipped" not in summary[0], summary


@pytest.mark.slow  # a child pytest under the interpreter: ~30 s
def test_triton_interpreter_suite() -> None:
    """This file's ``test_interpreted_*`` tests, under the interpreter."""
    run_interpreter_suite(__file__)


@dataclass
class Batch:
    """One attention step over a paged cache, plus each sequence's contiguous K/V."""

    q: torch.Tensor  # [num_tokens, heads, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, width]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, D]
    values: list[torch.Tensor]
    q_lens: list[int]
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments of paged_attention / paged_attention_reference."""
        return {
            "q": self.q, "k_cache": self.k_cache, "v_cache": self.v_cache,
            "block_tables": self.block_tables, "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc, "scale": self.scale,
            "max_query_len": max(self.q_lens), "max_seq_len": int(self.seq_lens.max()),
            "sliding_window": self.sliding_window, "softcap": self.softcap,
        }  # fmt: skip

    def reference(self) -> torch.Tensor:
        return paged_attention_reference(PagedAttentionInputs(**self.kwargs()))  # type: ignore[arg-type]

    def kernel(self, num_splits: int | None = None) -> torch.Tensor:
        inputs = PagedAttentionInputs(**self.kwargs())  # type: ignore[arg-type]
        return paged_attention(inputs, num_splits=num_splits)


def make_batch(
    specs: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Batch:
    """``specs``: one (cached tokens, query tokens) pair per sequence. Blocks are scattered at
    random over a pool with spare blocks; every slot no sequence owns holds NaN, so reading
    anything past a sequence's end shows up in the output.

    With a ``sliding_window``, the blocks wholly before every query's window are released as the
    engine releases them: their table entries name a NaN-filled spare block, so reading one
    shows up in the output too."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + n for cached, n in specs]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 1
    tables = torch.randint(0, num_blocks, (len(specs), width), generator=gen)  # padding: any id
    keys, values = [], []
    for s, length in enumerate(seq_lens):
        ids = [order.pop() for _ in range(need[s])]
        tables[s, : need[s]] = torch.tensor(ids)
        k = torch.randn(length, kv_heads, head_dim, generator=gen)
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        pos = torch.arange(length)
        k_cache[tables[s, pos // block_size], pos % block_size] = k
        v_cache[tables[s, pos // block_size], pos % block_size] = v
        if sliding_window is not None:
            # The first query sees positions from length - n - W + 1 on.
            dead = max(0, length - specs[s][1] - sliding_window + 1) // block_size
            tables[s, :dead] = order[0]  # a spare block (never popped): all NaN
        keys.append(k.to(device, dtype))
        values.append(v.to(device, dtype))
    q_lens = [n for _, n in specs]
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    return Batch(
        q=torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(device, dtype),
        k_cache=k_cache.to(device, dtype),
        v_cache=v_cache.to(device, dtype),
        block_tables=tables.to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device, torch.int32),
        keys=keys,
        values=values,
        q_lens=q_lens,
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
        softcap=softcap,
    )


def contiguous_attention(b: Batch) -> torch.Tensor:
    """Plain causal attention per sequence over its whole contiguous K/V: the queries of a
    sequence are the last rows of a full-length causal attention (earlier rows are zero and
    dropped). SDPA, or with a window or soft-cap transformers' eager formula written out."""
    outs, start = [], 0
    for keys, values, n in zip(b.keys, b.values, b.q_lens, strict=True):
        length = keys.shape[0]
        q = b.q.new_zeros(length, *b.q.shape[1:]).float().transpose(0, 1)  # [heads, L, D]
        q[:, length - n :] = b.q[start : start + n].float().transpose(0, 1)
        k, v = keys.float().transpose(0, 1), values.float().transpose(0, 1)  # [kv_heads, L, D]
        if b.sliding_window is None and b.softcap is None:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=b.scale, enable_gqa=True
            )
        else:
            group = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            scores = q @ k.transpose(1, 2) * b.scale  # [heads, L, L]
            if b.softcap is not None:
                scores = torch.tanh(scores / b.softcap) * b.softcap
            pos = torch.arange(length)
            allowed = pos[None, :] <= pos[:, None]
            if b.sliding_window is not None:
                allowed &= pos[None, :] > pos[:, None] - b.sliding_window
            o = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
        outs.append(o.transpose(0, 1)[length - n :])
        start += n
    return torch.cat(outs).to(b.q.dtype)


def edges(bs: int) -> list[int]:
    """Sequence lengths ending exactly on and just past block boundaries."""
    return [bs, bs + 1, 2 * bs, 2 * bs + 1]


# (id, specs, heads, kv_heads, head_dim, block_size, split counts to try)
KERNEL_CASES = [
    ("decode-gqa1-bs8-d64", [(n - 1, 1) for n in [1, *edges(8)]], 2, 2, 64, 8, (1, 3)),
    ("decode-gqa2-bs16-d128", [(n - 1, 1) for n in edges(16)], 4, 2, 128, 16, (1, 2)),
    ("decode-gqa4-bs32-d64", [(n - 1, 1) for n in edges(32)], 4, 1, 64, 32, (1, 4)),
    ("decode-gqa8-bs128-d128", [(n - 1, 1) for n in (128, 129, 5)], 8, 1, 128, 128, (1, 2)),
    ("prefill-gqa1-bs16-d64", [(0, n) for n in (16, 17, 3)], 2, 2, 64, 16, (1, 3)),
    ("prefill-gqa4-bs8-d128", [(0, n) for n in (8, 9, 24)], 4, 1, 128, 8, (1, 2)),
    ("prefill-gqa8-bs128-d64", [(0, 40), (0, 7)], 8, 1, 64, 128, (1, 2)),
    ("mixed-gqa2-bs8-d64", [(8, 1), (0, 9), (7, 10), (16, 1), (3, 2)], 4, 2, 64, 8, (1, 3)),
    ("mixed-gqa4-bs16-d128", [(16, 16), (31, 1), (15, 2), (0, 1)], 8, 2, 128, 16, (1, 2)),
    ("mixed-gqa8-bs32-d64", [(32, 33), (64, 1), (1, 31)], 8, 1, 64, 32, (1, 4)),
    ("mixed-gqa1-bs128-d128", [(100, 29), (128, 1), (0, 2)], 1, 1, 128, 128, (1, 3)),
    ("gqa3-d80-bs16", [(10, 6), (17, 1)], 6, 2, 80, 16, (1, 2)),  # padded group and head_dim
    ("small-d16", [(5, 3), (40, 1)], 4, 2, 16, 8, (1, 2)),
    ("small-d32", [(3, 40), (9, 1)], 2, 1, 32, 16, (1,)),  # 40 queries: several query blocks
]


@pytest.mark.parametrize(
    ("specs", "heads", "kv_heads", "head_dim", "block_size", "splits"),
    [pytest.param(*case[1:], id=case[0]) for case in KERNEL_CASES],
)
def test_interpreted_kernel_matches_reference(
    interpret: None,
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    splits: tuple[int, ...],
) -> None:
    b = make_batch(specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    expected = b.reference()
    assert not expected.isnan().any()
    for num_splits in splits:
        out = b.kernel(num_splits)
        assert out.shape == b.q.shape and out.dtype == b.q.dtype
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, msg=f"splits={num_splits}")


# (id, specs, heads, kv_heads, head_dim, block_size, sliding_window, softcap, split counts)
WINDOW_CASES = [
    # Decode far past the window (released blocks hold NaN), windows off block boundaries.
    ("win-decode-bs8-w5", [(n - 1, 1) for n in (3, 8, 9, 40, 77)], 4, 2, 32, 8, 5, None, (1, 3)),
    (
        "win-decode-bs16-w16",
        [(n - 1, 1) for n in (16, 17, 33, 100)],
        4,
        1,
        64,
        16,
        16,
        None,
        (1, 2),
    ),
    # Prefill and chunks longer than the window: later queries of a tile see fewer keys.
    ("win-prefill-bs8-w7", [(0, 30), (0, 5), (21, 19)], 4, 2, 32, 8, 7, None, (1, 2)),
    ("win-mixed-bs16-w20", [(50, 1), (0, 45), (33, 12), (3, 1)], 8, 2, 32, 16, 20, None, (1, 3)),
    ("softcap-mixed-bs8", [(9, 1), (0, 20), (17, 6)], 4, 2, 32, 8, None, 0.5, (1, 2)),
    ("win-softcap-bs16", [(40, 1), (10, 30), (0, 3)], 4, 1, 16, 16, 12, 2.0, (1, 3)),
]


def _window_case_params() -> list[Any]:
    return [pytest.param(*case[1:], id=case[0]) for case in WINDOW_CASES]


@pytest.mark.parametrize(
    ("specs", "heads", "kv_heads", "head_dim", "block_size", "window", "softcap", "splits"),
    _window_case_params(),
)
def test_interpreted_kernel_window_and_softcap(
    interpret: None,
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    softcap: float | None,
    splits: tuple[int, ...],
) -> None:
    """Sliding window and soft-cap in the kernel, against the reference (which is checked
    against contiguous eager attention below); released blocks are never read."""
    b = make_batch(
        specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        sliding_window=window, softcap=softcap, seed=block_size,
    )  # fmt: skip
    expected = b.reference()
    assert not expected.isnan().any()
    # The window and the cap change the result: a kernel ignoring them cannot pass.
    plain = replace(b, sliding_window=None, softcap=None)
    if window is None:  # (with a window the plain reference would read the released blocks)
        assert not torch.allclose(plain.reference(), expected, atol=1e-3)
    for num_splits in (*splits, None):
        out = b.kernel(num_splits)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, msg=f"splits={num_splits}")


@pytest.mark.parametrize(
    ("specs", "heads", "kv_heads", "head_dim", "block_size", "window", "softcap", "splits"),
    _window_case_params(),
)
@pytest.mark.parametrize("one_seq_per_chunk", [False, True])
def test_reference_window_and_softcap_match_eager(
    monkeypatch: pytest.MonkeyPatch,
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None,
    softcap: float | None,
    splits: tuple[int, ...],
    one_seq_per_chunk: bool,
) -> None:
    if one_seq_per_chunk:
        monkeypatch.setattr(reference_module, "_DECODE_CHUNK_BYTES", 1)
    b = make_batch(
        specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        sliding_window=window, softcap=softcap, seed=block_size,
    )  # fmt: skip
    expected = contiguous_attention(b)
    torch.testing.assert_close(b.reference(), expected, atol=1e-5, rtol=1e-5)
    if window is not None:  # the window matters: full attention differs
        full = contiguous_attention(replace(b, sliding_window=None))
        assert not torch.allclose(full, expected, atol=1e-3)


def test_interpreted_kernel_strided_inputs_and_auto_splits(interpret: None) -> None:
    """q as a view of a fused qkv tensor, caches as views of a [layers, 2, ...] pool, and the
    launcher's own choice of splits: strides are honoured, nothing is assumed contiguous."""
    b = make_batch([(20, 1), (3, 5), (40, 1)], heads=4, kv_heads=2, head_dim=64, block_size=8)
    qkv = torch.randn(b.q.shape[0], 3 * 4, 64)
    qkv[:, :4] = b.q
    pool = torch.randn(3, 2, *b.k_cache.shape)
    pool[1, 0], pool[1, 1] = b.k_cache, b.v_cache
    strided = replace(b, q=qkv[:, :4], k_cache=pool[1, 0], v_cache=pool[1, 1])
    assert not strided.q.is_contiguous()
    expected = b.reference()
    torch.testing.assert_close(strided.kernel(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(strided.reference(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("one_seq_per_chunk", [False, True])
def test_reference_matches_contiguous_attention(
    monkeypatch: pytest.MonkeyPatch,
    block_size: int,
    heads: int,
    kv_heads: int,
    one_seq_per_chunk: bool,
) -> None:
    if one_seq_per_chunk:  # the decode batch is cut into chunks; make every chunk one sequence
        monkeypatch.setattr(reference_module, "_DECODE_CHUNK_BYTES", 1)
    specs = [
        (block_size - 1, 1),  # decode ending on a block boundary
        (block_size, 1),  # ... and just past it
        (0, block_size + 1),  # prefill
        (block_size, 3),  # prefill after a cached prefix
        (2 * block_size - 2, 2),  # chunk ending on a boundary
        (0, 1),
        (5, 1),
    ]
    b = make_batch(
        specs, heads=heads, kv_heads=kv_heads, head_dim=32, block_size=block_size, seed=block_size
    )
    torch.testing.assert_close(b.reference(), contiguous_attention(b), atol=1e-5, rtol=1e-5)


def test_reference_bfloat16_stays_close_to_fp32() -> None:
    b = make_batch([(9, 1), (0, 12), (4, 4)], heads=4, kv_heads=2, head_dim=64, block_size=8)
    out32 = b.reference()
    b16 = replace(b, q=b.q.bfloat16(), k_cache=b.k_cache.bfloat16(), v_cache=b.v_cache.bfloat16())
    out16 = b16.reference()
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), out32, atol=3e-2, rtol=3e-2)


def test_choose_num_splits() -> None:
    # The kernel benchmark's shape (64 sequences x 8 KV heads) fills an H200 (132 SMs) already.
    assert choose_num_splits(64, 8, 1, 2048, num_sms=132) == 1
    # One long sequence: split as far as the cap allows.
    assert choose_num_splits(1, 8, 1, 32768, num_sms=132) == 32
    # Short contexts are not split below 256 positions per split.
    assert choose_num_splits(1, 8, 1, 600, num_sms=132) == 3
    assert choose_num_splits(2, 4, 1, 100, num_sms=132) == 1


def test_triton_usable() -> None:
    assert triton_usable("cpu") is False
    assert triton_usable("cuda") is (HAS_TRITON and not LIVE and torch.cuda.is_available())


def test_package_imports_without_triton() -> None:
    """A CPU-only install without triton imports the package and runs the references; the
    Triton launchers refuse with a ValueError."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from quire_engine.kernels import paged_attention_inputs as pa, triton_runtime as rt\n"
        "from quire_engine.kernels import paged_attention_reference as r\n"
        "from quire_engine.kernels import paged_attention_triton as t\n"
        "assert not rt.HAS_TRITON and not rt.triton_usable('cuda')\n"
        "q = torch.randn(1, 2, 16); c = torch.randn(2, 4, 2, 16); i = torch.int32\n"
        "args = (q, c, c, torch.tensor([[1]], dtype=i), torch.tensor([3], dtype=i),\n"
        "        torch.tensor([0, 1], dtype=i), 0.25)\n"
        "out = r.paged_attention_reference(pa.PagedAttentionInputs(*args, 1, 3))\n"
        "assert out.shape == q.shape\n"
        "try:\n"
        "    t.paged_attention(pa.PagedAttentionInputs(*args, 1, 3))\n"
        "except ValueError as e:\n"
        "    assert 'triton is not installed' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no ValueError')\n"
    )
    engine_dir = Path(__file__).resolve().parents[3] / "engine"
    env = {
        **os.environ,
        "PYTHONPATH": f"{engine_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


_FLOAT_ARGS = ("scale_log2", "softcap", "k_fixed", "v_fixed")  # the kernels' fp32 scalars


def _compile_for_hopper(kernel: object, pointers: dict[str, str], config: dict[str, Any]) -> Any:
    """Compile a kernel to a cubin for sm_90 with triton's own ptxas: no GPU needed; returns
    triton's compiled kernel. Integer arguments are i32 and, like the strides the launchers
    pass, divisible by 16; pointers not in ``pointers`` (unused ones) are typed i32 too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in config.items() if k != "num_warps"}
    names: list[str] = kernel.arg_names  # type: ignore[attr-defined]
    signature = {
        n: "constexpr"
        if n in constexprs
        else pointers.get(n, "fp32" if n in _FLOAT_ARGS else "i32")
        for n in names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n in pointers or n.startswith("stride")
    }
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": config.get("num_warps", 4)},
    )
    assert compiled.asm["cubin"]
    return compiled


_TRITON_8BIT = {torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_I8, _E4M3, _E5M2 = _TRITON_8BIT  # 8-bit KV caches (issue 39)


@pytest.mark.skipif(LIVE, reason="kernels are wrapped for the interpreter in this process")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "block_size", "max_query_len", "splits", "gemma2",
     "kv_dtype"),
    [
        pytest.param(torch.bfloat16, 32, 8, 128, 16, 1, 1, False, None,
                     id="bf16-decode-bench-shape"),
        pytest.param(torch.bfloat16, 32, 8, 128, 16, 1, 4, False, None, id="bf16-decode-splits"),
        pytest.param(torch.bfloat16, 16, 2, 64, 128, 512, 1, False, None, id="bf16-prefill-gqa8"),
        pytest.param(torch.float32, 8, 8, 128, 16, 256, 2, False, None, id="fp32-prefill-splits"),
        # Gemma 2's shape: head_dim 256, a sliding window and a soft-cap.
        pytest.param(torch.bfloat16, 16, 8, 256, 16, 1, 2, True, None,
                     id="bf16-window-softcap-d256"),
        pytest.param(torch.bfloat16, 16, 8, 256, 16, 128, 1, True, None,
                     id="bf16-window-prefill"),
        # 8-bit caches: every format on the bench's bf16 decode shape, and each meets another
        # path (fp16 queries dequantize the V tile; fp32; Gemma 2's window and soft-cap). The
        # write compiles with dynamic scales, and with fixed ones on the Gemma 2 shape.
        pytest.param(torch.bfloat16, 32, 8, 128, 16, 1, 1, False, _I8, id="i8-bf16-decode"),
        pytest.param(torch.bfloat16, 32, 8, 128, 16, 1, 4, False, _E4M3,
                     id="e4m3-bf16-decode-splits"),
        pytest.param(torch.bfloat16, 32, 8, 128, 16, 1, 1, False, _E5M2, id="e5m2-bf16-decode"),
        pytest.param(torch.float16, 16, 2, 64, 128, 512, 1, False, _E5M2,
                     id="e5m2-fp16-prefill-gqa8"),
        pytest.param(torch.float32, 8, 8, 128, 16, 256, 2, False, _I8,
                     id="i8-fp32-prefill-splits"),
        pytest.param(torch.bfloat16, 16, 8, 256, 16, 128, 2, True, _E4M3,
                     id="e4m3-bf16-window-softcap-d256"),
    ],
)  # fmt: skip
def test_kernels_compile_for_hopper(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    splits: int,
    gemma2: bool,
    kv_dtype: torch.dtype | None,
) -> None:
    """The interpreter does not type-check like the compiler; this builds the CUDA path (stage
    1, the merge and write_kv) for an H100/H200 on a machine without one. With ``kv_dtype``
    the caches are 8-bit (``tl.float8e4nv``, ``tl.float8e5``, ``i8``) with fp32 scales, and the
    write is the quantizing one."""
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    elem = "*" + _TRITON_TYPES[dtype]
    cache = elem if kv_dtype is None else "*" + _TRITON_8BIT[kv_dtype]
    part = elem if splits == 1 else "*fp32"
    kv8 = kv_dtype is not None
    config = _stage1_config(dtype, heads, kv_heads, head_dim, block_size, max_query_len, kv8=kv8)
    pointers = {
        "q_ptr": elem, "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": part,
        "lse_ptr": part, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
    }  # fmt: skip
    flags = {"HAS_WINDOW": gemma2, "HAS_SOFTCAP": gemma2}
    _compile_for_hopper(
        _paged_attention_kernel, pointers, {**config, **flags, "NUM_SPLITS": splits}
    )
    if splits > 1 and not kv8:
        pointers = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": elem}
        _compile_for_hopper(_merge_splits_kernel, pointers, _merge_config(heads, splits, head_dim))
    elif max_query_len == 1 or kv8:
        pointers = {
            "key_ptr": elem, "value_ptr": elem, "k_cache_ptr": cache, "v_cache_ptr": cache,
            "slot_mapping_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
        }  # fmt: skip
        write_config = _write_config(
            kv_dtype or dtype, block_size, kv_heads, head_dim, fixed=kv8 and gemma2
        )
        _compile_for_hopper(_write_kv_kernel, pointers, write_config)


# ---------------------------------------------------------------------------------------------
# KV cache writes, copies and swaps


def _kv_write_case(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(6, 8, 2, 32, generator=gen)
    v_cache = torch.randn(6, 8, 2, 32, generator=gen)
    slots = torch.tensor([0, 7, 8, 17, 47, 30, 31], dtype=torch.int64)
    # key/value as the model produces them: [kv_heads, T, D] transposed, so not contiguous.
    key = torch.randn(2, 7, 32, generator=gen).transpose(0, 1)
    value = torch.randn(2, 7, 32, generator=gen).transpose(0, 1)
    return key, value, k_cache, v_cache, slots


def _expected_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        k_cache[slot // 8, slot % 8] = key[t]
        v_cache[slot // 8, slot % 8] = value[t]
    return k_cache, v_cache


def test_write_kv_reference_exact() -> None:
    key, value, k_cache, v_cache, slots = _kv_write_case()
    want_k, want_v = _expected_write(key, value, k_cache, v_cache, slots)
    write_kv(key, value, k_cache, v_cache, slots)  # CPU: dispatches to the reference
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_interpreted_write_kv_exact(interpret: None) -> None:
    key, value, k_cache, v_cache, slots = _kv_write_case(1)
    want_k, want_v = _expected_write(key, value, k_cache, v_cache, slots)
    write_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # A head count that is not a power of two goes through the padded lanes.
    cache = torch.zeros(2, 4, 3, 16)
    kv = torch.arange(2 * 3 * 16, dtype=torch.float32).view(2, 3, 16)
    write_kv_triton(kv, -kv, cache, cache, torch.tensor([5, 2]))
    assert torch.equal(cache[1, 1], -kv[0]) and torch.equal(cache[0, 2], -kv[1])


def test_copy_blocks_exact() -> None:
    layers = [torch.randn(5, 4, 2, 8) for _ in range(3)]
    k_caches, v_caches = layers[:2], [layers[2], torch.randn(5, 4, 2, 8)]
    before = [c.clone() for c in (*k_caches, *v_caches)]
    # Block 1 is both a destination and (for 3 <- 1) a source: the copy reads old contents.
    copy_blocks(k_caches, v_caches, [(0, 1), (1, 3)])
    for old, new in zip(before, (*k_caches, *v_caches), strict=True):
        assert torch.equal(new[1], old[0]) and torch.equal(new[3], old[1])
        assert torch.equal(new[[0, 2, 4]], old[[0, 2, 4]])
    copy_blocks(k_caches, v_caches, [])  # no-op


def test_swap_blocks_exact() -> None:
    device_pool = [torch.randn(6, 4, 2, 8) for _ in range(2)]
    host_pool = [torch.zeros(3, 4, 2, 8) for _ in range(2)]
    swap_blocks(device_pool, host_pool, [(5, 0), (2, 2)])  # swap out
    for dev, host in zip(device_pool, host_pool, strict=True):
        assert torch.equal(host[0], dev[5]) and torch.equal(host[2], dev[2])
        assert not host[1].any()
    fresh = [torch.zeros(6, 4, 2, 8) for _ in range(2)]
    swap_blocks(host_pool, fresh, [(0, 1), (2, 4)])  # swap in, to other block ids
    for dev, new in zip(device_pool, fresh, strict=True):
        assert torch.equal(new[1], dev[5]) and torch.equal(new[4], dev[2])


# ---------------------------------------------------------------------------------------------
# Bad input


def _good() -> dict[str, object]:
    b = make_batch([(3, 1), (0, 4)], heads=4, kv_heads=2, head_dim=16, block_size=8)
    return b.kwargs()


def _bad_attention_inputs() -> list[tuple[str, dict[str, object], str]]:
    good = _good()
    q, k, v = (torch.as_tensor(good[name]) for name in ("q", "k_cache", "v_cache"))
    bt, sl, qsl = (
        torch.as_tensor(good[n]) for n in ("block_tables", "seq_lens", "query_start_loc")
    )
    return [
        ("q 2-D", {"q": q[:, 0]}, "q must be"),
        ("dtype mix", {"k_cache": k.double(), "v_cache": v.double()}, "q must be one of"),
        ("int dtype", {"q": q.int(), "k_cache": k.int(), "v_cache": v.int()}, "q must be one of"),
        ("v shape", {"v_cache": v[:, :4]}, "v_cache shape"),
        ("head_dim", {"q": torch.randn(5, 4, 8)}, "head_dim"),
        ("gqa", {"q": torch.randn(5, 3, 16)}, "multiple of num_kv_heads"),
        ("int64 tables", {"block_tables": bt.long()}, "block_tables must be"),
        ("seq_lens 2-D", {"seq_lens": sl[None]}, "seq_lens must be"),
        ("qsl length", {"query_start_loc": qsl[:2]}, "query_start_loc"),
        ("strided D", {"q": torch.randn(5, 4, 32)[:, :, ::2]}, "contiguous in head_dim"),
        ("scale", {"scale": -1.0}, "scale must be"),
        ("max_query_len", {"max_query_len": 0}, "max_query_len"),
        ("narrow tables", {"max_seq_len": 17}, "fewer than max_seq_len"),
        ("q_len > max", {"max_query_len": 3}, "query lengths"),
        ("qsl end", {"query_start_loc": torch.tensor([0, 1, 4], dtype=torch.int32)}, "from 0"),
        ("seq < q", {"seq_lens": torch.tensor([4, 3], dtype=torch.int32)}, "seq_lens"),
        ("block id", {"block_tables": torch.full_like(bt, 99)}, "outside"),
        ("device", {"q": q.to("meta")}, "one device"),
        ("window 0", {"sliding_window": 0}, "sliding_window must be"),
        ("window float", {"sliding_window": 4.0}, "sliding_window must be"),
        ("softcap", {"softcap": 0.0}, "softcap must be"),
        ("softcap inf", {"softcap": float("inf")}, "softcap must be"),
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [pytest.param(c, m, id=name) for name, c, m in _bad_attention_inputs()],
)
@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
def test_attention_rejects_bad_input(
    fn: Callable[..., torch.Tensor], change: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fn(PagedAttentionInputs(**{**_good(), **change}))  # type: ignore[arg-type]


@pytest.mark.skipif(LIVE, reason="the interpreter accepts CPU tensors")
def test_triton_launchers_refuse_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="reference"):
        paged_attention(PagedAttentionInputs(**_good()))  # type: ignore[arg-type]
    key, value, k_cache, v_cache, slots = _kv_write_case()
    with pytest.raises(ValueError, match="reference"):
        write_kv_triton(key, value, k_cache, v_cache, slots)


def test_num_splits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(PagedAttentionInputs(**_good()), num_splits=0)  # type: ignore[arg-type]


def test_kv_ops_reject_bad_input() -> None:
    key, value, k_cache, v_cache, slots = _kv_write_case()
    for bad, match in [
        ((key, value, k_cache, v_cache, slots.int()), "int64"),
        ((key, value, k_cache, v_cache, slots[:3]), "num_tokens"),
        ((key.double(), value, k_cache, v_cache, slots), "one dtype"),
        ((key, value, k_cache, v_cache[:, :4], slots), "k_cache and v_cache"),
        ((key, value, k_cache, v_cache, slots + 100), "outside"),
    ]:
        with pytest.raises(ValueError, match=match):
            write_kv(*bad)
    caches = [torch.zeros(4, 2, 1, 4)]
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(caches, caches, [(0, 4)])
    with pytest.raises(ValueError, match="repeat"):
        copy_blocks(caches, caches, [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="layers"):
        copy_blocks(caches, [], [(0, 1)])
    with pytest.raises(ValueError, match="block shape"):
        swap_blocks(caches, [torch.zeros(4, 4, 1, 4)], [(0, 1)])
    with pytest.raises(ValueError, match="out of range"):
        swap_blocks(caches, [torch.zeros(2, 2, 1, 4)], [(3, 2)])


# ---------------------------------------------------------------------------------------------
# CUDA


GPU_SPECS = [
    [(n - 1, 1) for n in (1, 16, 17, 300, 2048, 2049)],  # decode, ragged
    [(0, 200), (0, 1), (0, 64)],  # prefill
    [(1000, 37), (16, 1), (0, 300), (4095, 1)],  # mixed, cached prefixes
    [(8191, 1)],  # one long decode: many splits
]


@gpu
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "block_size"),
    [
        pytest.param(torch.float32, 32, 8, 128, 16, id="fp32-gqa4-d128-bs16"),
        pytest.param(torch.bfloat16, 32, 8, 128, 16, id="bf16-gqa4-d128-bs16"),
        pytest.param(torch.bfloat16, 16, 2, 64, 128, id="bf16-gqa8-d64-bs128"),
        pytest.param(torch.float32, 8, 8, 64, 32, id="fp32-mha-d64-bs32"),
    ],
)
def test_cuda_kernel_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    atol, rtol = (2e-5, 0.0) if dtype == torch.float32 else (2e-2, 2e-2)
    for seed, specs in enumerate(GPU_SPECS):
        b = make_batch(
            specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
            dtype=dtype, device="cuda", seed=seed,
        )  # fmt: skip
        expected = b.reference()
        for num_splits in (None, 1, 5):
            out = b.kernel(num_splits)
            torch.testing.assert_close(
                out, expected, atol=atol, rtol=rtol, msg=f"{specs} splits={num_splits}"
            )
        # Gemma 2's attention: a sliding window (released blocks hold NaN) and a soft-cap.
        for window, softcap in ((100, None), (1000, 50.0), (None, 20.0)):
            b = make_batch(
                specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                dtype=dtype, device="cuda", seed=seed, sliding_window=window, softcap=softcap,
            )  # fmt: skip
            expected = b.reference()
            for num_splits in (None, 1, 5):
                torch.testing.assert_close(
                    b.kernel(num_splits), expected, atol=atol, rtol=rtol,
                    msg=f"{specs} window={window} softcap={softcap} splits={num_splits}",
                )  # fmt: skip


@gpu
def test_cuda_write_kv_and_swap() -> None:
    key, value, k_cache, v_cache, slots = (t.cuda() for t in _kv_write_case(2))
    want_k, want_v = _expected_write(key, value, k_cache, v_cache, slots)
    write_kv(key, value, k_cache, v_cache, slots)  # CUDA: the Triton kernel
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    host = [torch.zeros(2, *k_cache.shape[1:]), torch.zeros(2, *v_cache.shape[1:])]
    swap_blocks([k_cache, v_cache], host, [(3, 0), (1, 1)])
    assert torch.equal(host[0][0], k_cache[3].cpu()) and torch.equal(host[1][1], v_cache[1].cpu())
    swap_blocks(host, [k_cache, v_cache], [(0, 5)])
    assert torch.equal(k_cache[5], k_cache[3])


# ---------------------------------------------------------------------------------------------
# Kernel benchmark


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kernel_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_kernel_defaults_and_errors() -> None:
    args = _bench_args()
    assert (args.batch, args.context, args.num_heads, args.num_kv_heads, args.head_dim) == (
        64, 2048, 32, 8, 128,
    )  # fmt: skip
    assert (args.dtype, args.peak_gbps) == ("bf16", 4800.0)
    with pytest.raises(ValueError, match="multiple of --num-kv-heads"):
        kernel_bench.run(_bench_args("--num-kv-heads", "3"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            kernel_bench.run(args)


def test_cpu_bench_kernel_small() -> None:
    from tests.engine_tests.toolchain import require_native_kernels

    require_native_kernels()  # in CI a failure, not a skip
    with pytest.raises(ValueError, match="--dtype fp32"):
        kernel_bench.run(_bench_args("--device", "cpu"))  # bf16 by default
    result = kernel_bench.run(
        _bench_args("--device", "cpu", "--dtype", "fp32", "--batch", "3", "--context", "70",
                    "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
                    "--warmup", "1", "--iters", "3")
    )  # fmt: skip
    assert result["max_abs_diff_vs_sdpa"] < 1e-5
    assert result["bytes_per_call"] == 2 * 3 * 70 * 2 * 16 * 4 + 2 * 3 * 4 * 16 * 4
    assert all(result[f"{n}_gbps"] > 0 for n in ("native", "torch_plan", "sdpa_contiguous"))


@gpu
def test_cuda_bench_kernel_small() -> None:
    result = kernel_bench.run(_bench_args("--batch", "4", "--context", "300", "--iters", "3"))
    assert result["max_abs_diff_vs_sdpa"] < 2e-2
    assert result["paged_gbps"] > 0 and result["sdpa_gbps"] > 0
