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


def paged_decode(lib: native.Library) -> None:
    kernel = native.PagedDecode(lib)
    block_size, heads, kv_heads, head_dim, num_blocks = 4, 6, 2, 20, 16
    lens = [1, 4, 5, 13]
    tables = _tables(lens, block_size, num_blocks)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim)
    out = torch.empty_like(q)
    rows, lens_a = np.arange(len(lens), dtype=np.int64), np.array(lens, dtype=np.int64)
    for window, softcap, threads in ((None, None, 1), (3, None, 2), (None, 20.0, 2)):
        kernel(q, k, v, rows, tables, lens_a, 0.3, out, threads, window, softcap)
        assert torch.isfinite(out).all()


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
    }  # fmt: skip
    assert tuple(shapes) == native.DecoderDecode.LAYER_FIELDS
    keep = [{f: torch.randn(shape) * 0.1 for f, shape in shapes.items()} for _ in range(layers)]
    table = np.array([[t[f].data_ptr() for f in shapes] for t in keep], dtype=np.int64)
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
    for lm_bias_at in (lm_bias.data_ptr(), None):
        args = native.DecoderArgs(
            layers=table.ctypes.data, layer_fields=table.shape[1], num_layers=layers,
            windows=windows.ctypes.data, scales=scales.ctypes.data, embed=embed.data_ptr(),
            final_norm=norm.data_ptr(), lm_head=lm_head.data_ptr(), lm_bias=lm_bias_at,
            vocab=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            inter=inter, eps=1e-6, block_size=block_size, n=n, ids=ids.ctypes.data,
            cos=cos.data_ptr(), sin=sin.data_ptr(), rope_rows=positions.ctypes.data,
            slots=slots.ctypes.data, tables=tables.ctypes.data, table_stride=tables.shape[1],
            lens=lens_a.ctypes.data, logits=logits.data_ptr(), num_threads=2,
        )  # fmt: skip
        kernel(args)
        assert torch.isfinite(logits).all()


def main(directory: str) -> int:
    lib = _library(Path(directory))
    paged_decode(lib)
    skinny_linear(lib)
    decoder_decode(lib)
    print(f"ok: {lib.path} ({' '.join(lib.flags)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
