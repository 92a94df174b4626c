"""What one paged attention call takes, and the checks both implementations run on it.

The call is :class:`PagedAttentionInputs`; the Triton kernel
(:mod:`.paged_attention_triton`) and the torch reference (:mod:`.paged_attention_reference`)
take it with identical semantics. This module owns the layout and its validation; it launches
nothing.

Layout (one layer):

- ``q``: ``[num_tokens, num_heads, head_dim]``, the step's query tokens of all sequences
  concatenated; sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s + 1]``.
- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token position
  ``p`` of sequence ``s`` lives in block ``block_tables[s, p // block_size]`` at offset
  ``p % block_size``. The K/V of the step's own tokens are written before attention runs.
- ``seq_lens[s]``: context length including the step's query tokens, so query ``i`` of a sequence
  with ``q_len`` queries sits at position ``seq_lens[s] - q_len + i`` and sees positions ``<=`` it.
- ``sliding_window`` (optional, ``W``): a query at position ``p`` sees only ``p - W < pos <= p``,
  the last ``W`` positions including its own (transformers' ``sliding_window_overlay``). Blocks
  wholly before every query's window are never read, so their table entries may name any valid
  block (the KV cache manager releases them; see ``kv_cache_manager``).
- ``k_scale``, ``v_scale`` (8-bit pools only): float32 ``[num_blocks, block_size, num_kv_heads]``,
  one scale per token and KV head; position ``p`` of K reads back as ``float(k) * k_scale`` at
  the same (block, offset, head) (``kv_quant``). Readers dequantize what they load, never the
  pool.
- ``softcap`` (optional, ``c``): scores become ``c * tanh(scale * q.k / c)`` before the softmax
  (Gemma 2's attention logit soft-capping), as transformers' eager attention computes them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from quire_engine.kernels.kv_quant import QUANTIZED_DTYPES

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the dtypes q and the pools may have


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention call asks for (``model.attention.inspect_layers`` observes it
    at load time; the CPU decoder reads it): the per-layer options of :class:`PagedAttentionInputs`.
    """

    layer_idx: int
    sliding_window: int | None  # the layer sees its last `sliding_window` positions; None: all
    softcap: float | None  # attention logit soft-cap (Gemma 2); None: none
    scaling: float | None  # softmax scale; None: head_dim ** -0.5


class PagedAttentionInputs(NamedTuple):
    """One layer's paged attention call, as the Triton launcher (``paged_attention``) and the
    torch reference (``paged_attention_reference``) both take it; see the module docstring for
    the layout. Both check it (shapes, dtypes, devices, strides; the values too, on the host,
    except the CUDA launcher)."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim], head_dim contiguous
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    v_cache: torch.Tensor  # same shape and dtype as k_cache (q's, or an 8-bit one with scales)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including the step's queries
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query counts, from 0
    scale: float  # softmax scale, positive and finite
    max_query_len: int  # bounds every sequence's query count (sizes the grid)
    max_seq_len: int  # bounds every seq_lens entry (sizes the splits)
    sliding_window: int | None = None  # W >= 1: positions p - W < pos <= p are visible
    softcap: float | None = None  # c > 0: scores c * tanh(scale * q.k / c)
    k_scale: torch.Tensor | None = None  # fp32 [num_blocks, block_size, num_kv_heads]: 8-bit only
    v_scale: torch.Tensor | None = None


def check_inputs(inputs: PagedAttentionInputs) -> None:
    """Shapes, dtypes, devices and strides; raises ValueError naming what is wrong."""
    (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
     max_seq_len, sliding_window, softcap, k_scale, v_scale) = inputs  # fmt: skip
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    quantized = k_cache.dtype in QUANTIZED_DTYPES
    cache_ok = v_cache.dtype == k_cache.dtype and (quantized or k_cache.dtype == q.dtype)
    if q.dtype not in DTYPES or not cache_ok:
        raise ValueError(
            f"q must be one of {DTYPES} and k_cache and v_cache q's dtype or one of "
            f"{QUANTIZED_DTYPES}; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    scales = [t for t in (k_scale, v_scale) if t is not None]
    if quantized and (
        len(scales) != 2
        or any(t.shape != k_cache.shape[:3] or t.dtype != torch.float32 for t in scales)
    ):
        raise ValueError(
            f"an 8-bit cache needs float32 k_scale and v_scale of shape {tuple(k_cache.shape[:3])}"
        )
    if scales and not quantized:
        raise ValueError(f"k_scale and v_scale belong to 8-bit caches, not {k_cache.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"head_dim of q ({head_dim}) != head_dim of the cache ({k_cache.shape[3]})"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    for name, t, dims in (
        ("block_tables", block_tables, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if t.dtype != torch.int32 or t.dim() != dims:
            raise ValueError(
                f"{name} must be a {dims}-D int32 tensor, got {t.dtype} {tuple(t.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows and query_start_loc "
            f"{query_start_loc.shape[0]} entries for {num_seqs} sequences (want {num_seqs} and "
            f"{num_seqs + 1})"
        )
    devices = {
        t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *scales)
    }
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
    if not (isinstance(scale, float | int) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int)
        or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an integer >= 1, got {sliding_window!r}")
    if softcap is not None and not (
        isinstance(softcap, float | int) and math.isfinite(softcap) and softcap > 0
    ):
        raise ValueError(f"softcap must be None or a positive finite float, got {softcap!r}")
    if max_query_len < 1 or max_seq_len < max_query_len:
        raise ValueError(
            f"need 1 <= max_query_len <= max_seq_len, got {max_query_len} and {max_seq_len}"
        )
    if block_tables.shape[1] * k_cache.shape[1] < max_seq_len:
        raise ValueError(
            f"block_tables holds {block_tables.shape[1]} blocks of {k_cache.shape[1]} tokens, "
            f"fewer than max_seq_len={max_seq_len}"
        )


def check_values(inputs: PagedAttentionInputs) -> tuple[list[int], list[int], list[int]]:
    """Check the metadata values; returns (query starts, query lengths, sequence lengths).

    Reads the tensors on the host, so the CUDA launcher skips it (it would cost a sync)."""
    q, block_tables, num_blocks = inputs.q, inputs.block_tables, inputs.k_cache.shape[0]
    max_query_len, max_seq_len = inputs.max_query_len, inputs.max_seq_len
    starts = inputs.query_start_loc.tolist()
    lens = inputs.seq_lens.tolist()
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={q.shape[0]}: {starts}")
    if any(n < 1 or n > max_query_len for n in q_lens):
        raise ValueError(f"query lengths {q_lens} must lie in [1, max_query_len={max_query_len}]")
    if any(s < n or s > max_seq_len for s, n in zip(lens, q_lens, strict=True)):
        raise ValueError(
            f"seq_lens {lens} must lie in [query length, max_seq_len={max_seq_len}] "
            f"(query lengths {q_lens})"
        )
    if (
        block_tables.numel()
        and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks
    ):
        raise ValueError(f"block_tables holds ids outside [0, {num_blocks})")
    return starts, q_lens, lens
