"""Run every native kernel once on small, odd-sized inputs, from a library built with
AddressSanitizer: ``python -m tests.engine_tests.native_asan_driver CACHE_DIR``.

Started by ``test_native_builds.py`` in a child process with the ASan runtime preloaded; ASan
aborts the process with a report on any out-of-bounds access or use after free, so the test
asks only for exit status 0 and no report. Every tensor here is its own allocation of exactly
its size (torch's CPU allocator and numpy both take each from malloc), so a read or write past
any array's end lands in ASan's red zone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from quire_engine.cpu import native
from quire_engine.kernels.kv_quant import quantize

ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")


def _library(directory: Path) -> native.Library:
    # The engine's first flag set (vector units and OpenMP) where it builds, else none.
    for flags in (native.FLAG_SETS[0], ()):
        try:
            return native.build((*flags, *ASAN_FLAGS), directory)
        except RuntimeError as exc:
            problem = exc
    raise SystemExit(f"no AddressSanitizer build: {problem}")


def _tables(lens: list[int], block_size: int, num_blocks: int) -> np.ndarray:
    """int32 [n, W]: distinct blocks per sequence, W just wide enough for the longest."""
    need = [-(-length // block_size) for length in lens]
    perm = np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(lens), max(need)), dtype=np.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    return tables


# The 8-bit pool formats (kernels/kv_quant), read and written by the kernels below.
KV8 = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def paged_decode(lib: native.Library) -> None:
    kernel = native.PagedDecode(lib)
    block_size, kv_heads, head_dim, num_blocks = 4, 2, 20, 16
    lens = [1, 4, 5, 13]
    tables = _tables(lens, block_size, num_blocks)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    rows, lens_a = np.arange(len(lens), dtype=np.int64), np.array(lens, dtype=np.int64)
    # float32, bf16 and 8-bit pools, each a copy of its own size; 6 query heads per pass take the
    # per-head path, 16 (runs of 8) the grouped one.
    pools: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    pools = [(k, v, None, None), (k.bfloat16(), v.bfloat16(), None, None)]  # float32, bf16
    for dtype in KV8:
        (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
        pools.append((kq.clone(), vq.clone(), ks.clone(), vs.clone()))
    for heads in (6, 16):
        q = torch.randn(len(lens), heads, head_dim)
        out = torch.empty_like(q)
        for kc, vc, k_scale, v_scale in pools:
            for window, softcap, threads in ((None, None, 1), (3, None, 2), (None, 20.0, 2)):
                kernel(
                    q, kc, vc, rows, tables, lens_a, 0.3, out, threads, window, softcap,
                    k_scale, v_scale,
                )  # fmt: skip
                assert torch.isfinite(out).all()


def kv_quantize(lib: native.Library) -> None:
    kernel = native.KvQuantize(lib)
    x = torch.randn(5, 37)
    for dtype in KV8:
        for fixed in (None, 0.05):
            data, scales = kernel(x, dtype, fixed)
            assert scales.shape == (5,) and data.shape == x.shape


def skinny_linear(lib: native.Library) -> None:
    kernel = native.SkinnyLinear(lib)
    # Widths off the vector lanes; rows through every tiling: wide tiles, groups, blocked.
    for rows in (1, 2, 3, 5, 7, 17, 33):
        for k, n in ((37, 11), (24, 50), (600, 70)):
            x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
            out = torch.empty(rows, n)
            kernel(x, w, b, out, 2)
            torch.testing.assert_close(out, x @ w.T + b, rtol=1e-4, atol=1e-4)
            kernel(x, w, None, out, 1)


def decoder_decode(lib: native.Library) -> None:
    kernel = native.DecoderDecode(lib)
    layers, hidden, heads, kv_heads, head_dim, inter, vocab = 2, 44, 2, 1, 22, 100, 37
    block_size, num_blocks = 4, 16
    q_w, kv_w = heads * head_dim, kv_heads * head_dim
    shapes = {
        "input_norm": (hidden,), "q": (q_w, hidden), "q_bias": (q_w,), "k": (kv_w, hidden),
        "k_bias": (kv_w,), "v": (kv_w, hidden), "v_bias": (kv_w,), "o": (hidden, q_w),
        "o_bias": (hidden,), "post_norm": (hidden,), "gate": (inter, hidden),
        "gate_bias": (inter,), "up": (inter, hidden), "up_bias": (inter,),
        "down": (hidden, inter), "down_bias": (hidden,),
        "k_cache": (num_blocks, block_size, kv_heads, head_dim),
        "v_cache": (num_blocks, block_size, kv_heads, head_dim),
        "k_scale": (num_blocks, block_size, kv_heads),
        "v_scale": (num_blocks, block_size, kv_heads),
    }  # fmt: skip
    assert tuple(shapes) == native.DecoderDecode.LAYER_FIELDS
    pool_fields = ("k_cache", "v_cache", "k_scale", "v_scale")
    weights = [
        {f: torch.randn(shape) * 0.1 for f, shape in shapes.items() if f not in pool_fields}
        for _ in range(layers)
    ]
    windows = np.array([0, 3], dtype=np.int64)  # a full layer and a windowed one
    scales = np.full(layers, head_dim**-0.5, dtype=np.float32)
    embed, norm = torch.randn(vocab + 3, hidden), torch.ones(hidden)
    lm_head, lm_bias = torch.randn(vocab, hidden), torch.randn(vocab)
    lens = [1, 5, 9]
    n = len(lens)
    tables = _tables(lens, block_size, num_blocks)
    positions = np.array(lens, dtype=np.int64) - 1
    slots = np.array(
        [tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(positions)],
        dtype=np.int64,
    )
    cos, sin = torch.randn(int(positions.max()) + 1, head_dim), torch.randn(9, head_dim)
    ids, lens_a = np.array([0, vocab + 2, 7], dtype=np.int64), np.array(lens, dtype=np.int64)
    logits = torch.empty(n, vocab)
    # float32 pools (no scales: address 0), each 8-bit format's with dynamic scales, and e4m3
    # with fixed per-layer ones; every pool and scale pool its own allocation.
    fixed = np.array([[0.02, 0.03], [0.05, 0.01]], dtype=np.float32)
    runs = [(torch.float32, None), *((dtype, None) for dtype in KV8), (KV8[1], fixed)]
    for (dtype, kv_fixed), lm_bias_at in zip(runs, [lm_bias.data_ptr(), None] * 3, strict=False):
        pools = []
        for w in weights:
            t = dict(w)
            t["k_cache"], t["v_cache"] = (torch.zeros(shapes["k_cache"], dtype=dtype) for _ in "kv")
            if dtype != torch.float32:
                t["k_scale"], t["v_scale"] = (torch.zeros(shapes["k_scale"]) for _ in "kv")
            pools.append(t)
        table = np.array([[t[f].data_ptr() if f in t else 0 for f in shapes] for t in pools])
        args = native.DecoderArgs(
            layers=table.ctypes.data, layer_fields=table.shape[1], num_layers=layers,
            windows=windows.ctypes.data, scales=scales.ctypes.data, embed=embed.data_ptr(),
            final_norm=norm.data_ptr(), lm_head=lm_head.data_ptr(), lm_bias=lm_bias_at,
            vocab=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            inter=inter, eps=1e-6, block_size=block_size, kv_kind=native.KV_KINDS[dtype],
            kv_fixed=None if kv_fixed is None else kv_fixed.ctypes.data, n=n,
            ids=ids.ctypes.data, cos=cos.data_ptr(), sin=sin.data_ptr(),
            rope_rows=positions.ctypes.data, slots=slots.ctypes.data,
            tables=tables.ctypes.data, table_stride=tables.shape[1], lens=lens_a.ctypes.data,
            logits=logits.data_ptr(), num_threads=2,
        )  # fmt: skip
        kernel(args)
        assert torch.isfinite(logits).all()


def main(directory: str) -> int:
    lib = _library(Path(directory))
    paged_decode(lib)
    kv_quantize(lib)
    skinny_linear(lib)
    decoder_decode(lib)
    print(f"ok: {lib.path} ({' '.join(lib.flags)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
