"""Causal attention over a paged KV cache: one Triton kernel for prefill, prefill with a cached
prefix, chunked prefill and decode, plus the torch reference that is also the engine's CPU path.

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
- ``softcap`` (optional, ``c``): scores become ``c * tanh(scale * q.k / c)`` before the softmax
  (Gemma 2's attention logit soft-capping), as transformers' eager attention computes them.

Kernel plan (flash-decoding). Stage 1 runs one program per (sequence, block of ``BLOCK_Q`` query
tokens, KV head, split). The ``group = num_heads // num_kv_heads`` query heads that share a KV
head are packed into the rows of one tile (row ``r`` = query token ``r // GROUP_PAD``, head
``r % GROUP_PAD``), so Q·Kᵀ is a ``tl.dot`` of at least 16 rows even at decode time, and each
K/V tile is loaded once for the whole group. A split walks its share of the context in tiles of
``BLOCK_N`` positions with an online softmax in fp32. With one split the program writes the final
output; with several it writes a partial output and its log-sum-exp, and stage 2 merges them.
Splits keep the GPU busy when there are few (sequence, KV head) pairs and long contexts.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from quire_engine.kernels import HAS_TRITON, check_launchable, jit

if HAS_TRITON:
    import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E) if HAS_TRITON else _LOG2E  # the same, as a kernel constant
_MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves
_MAX_SPLITS = 32
_DECODE_CHUNK_BYTES = 2 << 20  # fp32 bytes of gathered K per batched SDPA call (decode_chunks)


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
    """One layer's paged attention call, as :func:`paged_attention` (Triton) and
    :func:`paged_attention_reference` (torch) both take it; see the module docstring for the
    layout. Both launchers check it (shapes, dtypes, devices, strides; the values too, on the
    host, except the CUDA launcher)."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim], head_dim contiguous
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    v_cache: torch.Tensor  # same shape and dtype as k_cache
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including the step's queries
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query counts, from 0
    scale: float  # softmax scale, positive and finite
    max_query_len: int  # bounds every sequence's query count (sizes the grid)
    max_seq_len: int  # bounds every seq_lens entry (sizes the splits)
    sliding_window: int | None = None  # W >= 1: positions p - W < pos <= p are visible
    softcap: float | None = None  # c > 0: scores c * tanh(scale * q.k / c)


@jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # annotations mean types to Triton
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same layout as k_cache
    out_ptr,  # [num_tokens, num_heads, head_dim] (1 split) or fp32 [.., num_splits, head_dim]
    lse_ptr,  # fp32 [num_tokens, num_heads, num_splits], log2 units; unused with 1 split
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int32 [num_seqs]
    query_start_loc_ptr,  # int32 [num_seqs + 1]
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    window,  # sliding window W (positions p - W < pos <= p are visible); unused without HAS_WINDOW
    softcap,  # logit soft-cap c; unused without HAS_SOFTCAP
    stride_qt, stride_qh,  # q: token, head
    stride_kb, stride_kt, stride_kh,  # k_cache: block, slot, head
    stride_vb, stride_vt, stride_vh,  # v_cache
    stride_ot, stride_oh, stride_os,  # out: token, head, split (0 with one split)
    stride_lt, stride_lh,  # lse: token, head
    stride_bt,  # block_tables: sequence
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows of the Q tile: max(16, BLOCK_Q * GROUP_PAD)
    BLOCK_N: tl.constexpr,  # key positions per loop step
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # power of two >= 16, as tl.dot needs
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 so tests match the reference; else unused
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest query of the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # positions before this step's first query token

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] query index within the sequence
    grp = rows % GROUP_PAD
    head = kv_head * GROUP + grp  # [BLOCK_M] query head
    row_ok = (tok < q_len) & (grp < GROUP)
    q_pos = cached + tok  # [BLOCK_M] absolute position: the causal limit of the row
    token = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q = tl.load(  # [BLOCK_M, HEAD_DIM_PAD]
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # The keys this program's queries may see: up to its last query's position and, with a
    # window, from the first query's window start (earlier blocks may already be released).
    # Each split takes an equal share of that range, rounded up to BLOCK_N.
    kv_hi = tl.minimum(cached + (q_block + 1) * BLOCK_Q, seq_len)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(cached + q_block * BLOCK_Q - window + 1, 0)
    split_len = ((kv_hi - kv_lo + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, kv_hi)

    # Online softmax state. m starts finite so a row with nothing visible yet gives
    # exp2(-inf - m) = 0 rather than NaN; such rows end with l = 0.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    kv_off = kv_head * stride_kh
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        pos_ok = pos < hi
        # A tile may span several cache blocks (BLOCK_SIZE < BLOCK_N) or part of one: look up
        # the physical block of every position. int64 so block * stride cannot overflow.
        block = tl.load(
            block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0
        ).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_PAD, BLOCK_N], loaded transposed for the dot
            k_cache_ptr
            + block[None, :] * stride_kb
            + slot[None, :] * stride_kt
            + kv_off
            + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            # c * tanh(x / c) in log2 units, tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both
            # ends (exp2 overflows to inf, giving 1; underflows to 0, giving -1).
            y = s / (softcap * _LOG2E_C)
            s = (1.0 - 2.0 / (tl.exp2(y * (2.0 * _LOG2E_C)) + 1.0)) * (softcap * _LOG2E_C)
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :] & row_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(  # [BLOCK_N, HEAD_DIM_PAD]
            v_cache_ptr
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vt
            + kv_head * stride_vh
            + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0  # false for padding rows and for rows whose keys all lie in other splits
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * stride_ot
        + head[:, None] * stride_oh
        + split * stride_os
        + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@jit
def _merge_splits_kernel(  # type: ignore[no-untyped-def]  # annotations mean types to Triton
    part_ptr,  # fp32 [num_tokens, num_heads, num_splits, head_dim]: per-split normalised output
    lse_ptr,  # fp32 [num_tokens, num_heads, num_splits]: per-split log2-sum-exp2
    out_ptr,  # [num_tokens, num_heads, head_dim]
    stride_pt, stride_ph, stride_ps,  # part: token, head, split
    stride_lt, stride_lh,  # lse: token, head
    stride_ot, stride_oh,  # out: token, head
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # heads per program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    # One program per (token, block of heads) folds the splits in one at a time with the same
    # rescaling as the online softmax: registers hold [BLOCK_H, HEAD_DIM_PAD] whatever the
    # number of splits.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_ok = heads < NUM_HEADS
    mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: an empty split adds exp2(-inf)=0
    total = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    for split in range(NUM_SPLITS):
        lse = tl.load(  # [BLOCK_H]; -inf where the split saw no key for that query
            lse_ptr + token * stride_lt + heads * stride_lh + split,
            mask=head_ok,
            other=float("-inf"),
        )
        part = tl.load(  # [BLOCK_H, HEAD_DIM_PAD]
            part_ptr
            + token * stride_pt
            + heads[:, None] * stride_ph
            + split * stride_ps
            + dims[None, :],
            mask=mask,
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * weight[:, None]
        total = total * alpha + weight
        m = m_new
    # Every query sees at least its own position, so total > 0 on real heads.
    o = acc / tl.where(head_ok, total, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _stage1_config(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
) -> dict[str, Any]:
    """Constexprs (all but NUM_SPLITS) and ``num_warps`` of the stage-1 kernel.

    The tile sizes compile for sm_90 without register spills (checked with ptxas for head sizes
    64..256 and group sizes 1..8); fp32 tiles are half the 16-bit ones."""
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    head_dim_pad = max(16, _next_pow2(head_dim))
    fp32 = dtype == torch.float32
    block_q = max(1, min(_next_pow2(max_query_len), (32 if fp32 else 64) // group_pad))
    block_m = max(16, block_q * group_pad)
    return {
        "GROUP": group,
        "GROUP_PAD": group_pad,
        "BLOCK_Q": block_q,
        "BLOCK_M": block_m,
        "BLOCK_N": 64 // (2 if fp32 else 1) // (2 if head_dim_pad > 128 else 1),
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "DOT_PRECISION": "ieee" if fp32 else "tf32",
        "num_warps": 4 if block_m <= 16 else 8,
    }


def _merge_config(num_heads: int, num_splits: int, head_dim: int) -> dict[str, Any]:
    """Constexprs of the merge kernel."""
    return {
        "NUM_HEADS": num_heads,
        "NUM_SPLITS": num_splits,
        "BLOCK_H": min(16, _next_pow2(num_heads)),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": max(16, _next_pow2(head_dim)),
    }


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, num_q_blocks: int, max_seq_len: int, num_sms: int
) -> int:
    """Splits per (sequence, KV head): enough programs for about two per SM, none shorter than
    ``_MIN_TOKENS_PER_SPLIT`` positions. Large batches get 1 (no merge pass)."""
    programs = num_seqs * num_kv_heads * num_q_blocks
    if programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // programs)
    return max(1, min(wanted, -(-max_seq_len // _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS))


def _check_inputs(inputs: PagedAttentionInputs) -> None:
    """Shapes, dtypes, devices and strides; raises ValueError naming what is wrong."""
    (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
     max_seq_len, sliding_window, softcap) = inputs  # fmt: skip
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share one of {_DTYPES}; got {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
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
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}
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


def _check_values(inputs: PagedAttentionInputs) -> tuple[list[int], list[int], list[int]]:
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


def paged_attention(inputs: PagedAttentionInputs, *, num_splits: int | None = None) -> torch.Tensor:
    """Run the Triton kernel; returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    ``inputs.max_query_len`` and ``inputs.max_seq_len`` must bound the true lengths (they size
    the grid and the split count; on CUDA they are trusted, as checking would cost a host sync).
    ``num_splits`` defaults to :func:`choose_num_splits`. ``sliding_window`` and ``softcap``: see
    the module docstring.
    """
    _check_inputs(inputs)
    (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
     max_seq_len, sliding_window, softcap) = inputs  # fmt: skip
    if q.device.type == "cpu":
        _check_values(inputs)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    check_launchable(q.device, "paged_attention")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out

    config = _stage1_config(q.dtype, num_heads, num_kv_heads, head_dim, block_size, max_query_len)
    num_q_blocks = -(-max_query_len // config["BLOCK_Q"])
    if num_splits is None:
        sms = _num_sms(q.device.index or 0) if q.device.type == "cuda" else 8
        # A program reads at most its queries' window: split that, not the whole context.
        span = max_seq_len
        if sliding_window is not None:
            span = min(span, sliding_window + config["BLOCK_Q"] - 1)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, num_q_blocks, span, sms)

    if num_splits == 1:
        part, lse = out, out  # stage 1 writes the final output; lse is never touched
        part_split_stride = 0
    else:
        part = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_split_stride = part.stride(2)
    _paged_attention_kernel[(num_seqs, num_q_blocks, num_kv_heads * num_splits)](
        q, k_cache, v_cache, part, lse, block_tables, seq_lens, query_start_loc,
        float(scale) * _LOG2E,
        sliding_window or 0,
        float(softcap or 0.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        part.stride(0), part.stride(1), part_split_stride,
        lse.stride(0), lse.stride(1),
        block_tables.stride(0),
        NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, **config,
    )  # fmt: skip
    if num_splits > 1:
        merge = _merge_config(num_heads, num_splits, head_dim)
        _merge_splits_kernel[(num_tokens, -(-num_heads // merge["BLOCK_H"]))](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            **merge,
        )  # fmt: skip
    return out


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of a pool: cache ``[num_blocks, block_size, kv_heads, D]``, blocks
    int64 ``[n, nb]`` -> ``[n, nb * block_size, kv_heads, D]``, contiguous."""
    n, nb = blocks.shape
    gathered = torch.index_select(cache, 0, blocks.flatten())  # faster than cache[blocks] on CPU
    return gathered.view(n, nb * cache.shape[1], *cache.shape[2:])


def _attend(
    q: torch.Tensor,  # [B, heads, Lq, D] fp32
    k: torch.Tensor,  # [B, kv_heads, Lk, D] fp32
    v: torch.Tensor,  # [B, kv_heads, Lk, D] fp32
    mask: torch.Tensor | None,  # bool, broadcastable to [B, heads, Lq, Lk]; None: causal, Lq == Lk
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Softmax attention in fp32: SDPA, or with a soft-cap the eager formula transformers uses
    (SDPA has no soft-cap): ``softmax(c * tanh(scale * q.k / c) + mask) @ v``."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (scale / softcap)) * softcap
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def attend_decode(
    q: torch.Tensor,  # [n, heads, D] fp32: one query token per sequence
    k: torch.Tensor,  # [n, kv_heads, Lk, D] fp32
    v: torch.Tensor,  # [n, kv_heads, Lk, D] fp32
    mask: torch.Tensor,  # bool [n, 1, 1, Lk]: visible keys
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``[n, heads, D]``: one-token queries over gathered contexts. Grouped-query attention is
    computed with the heads that share a KV head (consecutive heads, as transformers' repeat_kv
    maps them) as that KV head's query rows, so SDPA reads each K/V once instead of once per
    query head (1.2-1.7x faster than ``enable_gqa=True`` on one CPU thread, same math)."""
    n, heads, head_dim = q.shape
    if softcap is not None:
        return _attend(q.unsqueeze(2), k, v, mask, scale, softcap).squeeze(2)
    grouped = q.view(n, k.shape[1], heads // k.shape[1], head_dim)  # [n, kv_heads, group, D]
    o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return o.reshape(n, heads, head_dim)


def decode_chunks(
    lens: Sequence[int], block_size: int, token_bytes: int, window_blocks: int | None = None
) -> Iterator[tuple[int, int, int]]:
    """``(start, end, num_blocks)`` of each batched decode chunk, over context lengths sorted
    longest first; a chunk gathers ``num_blocks`` blocks per sequence (its longest context's, at
    most ``window_blocks``). The rule of both CPU paths (the reference and ``CpuAttentionPlan``).

    Chunks keep each gathered K/V near ``_DECODE_CHUNK_BYTES`` (``token_bytes`` per token): it
    stays in cache, and the allocator recycles it (glibc returns buffers over ~32 MiB to the OS on
    free, so every call would page-fault a fresh one in: that cost more than the attention
    itself). A chunk also ends where contexts drop below half its padding, so ragged lengths
    (the normal case) do not all pay for the longest."""
    i = 0
    while i < len(lens):
        num_blocks = -(-lens[i] // block_size)
        if window_blocks is not None:
            num_blocks = min(num_blocks, window_blocks)
        padded = num_blocks * block_size
        end = i + 1
        limit = max(1, _DECODE_CHUNK_BYTES // (padded * token_bytes))
        while end < len(lens) and end - i < limit and 2 * lens[end] > padded:
            end += 1
        yield i, end, num_blocks
        i = end


def paged_attention_reference(
    inputs: PagedAttentionInputs, *, finite_cache: bool = False
) -> torch.Tensor:
    """Same semantics as :func:`paged_attention` in plain torch (fp32 math); the CPU path.

    ``finite_cache=True`` promises that every slot of the pools holds finite values (the engine
    zero-initialises its caches and only writes model K/V into them), which skips zeroing the
    V slots past each sequence's end or before its window.

    Decode sequences (one query token) run batched: their blocks are gathered into a padded
    ``[n, padded_len, kv_heads, D]`` context, masked by length, in one attention call per chunk of
    sequences. Sequences with several query tokens run one by one, with a causal mask shifted
    by their cached prefix. With a sliding window only the blocks that hold a visible position
    are gathered, so the cost follows the window, not the context.
    """
    _check_inputs(inputs)
    q, k_cache, v_cache, block_tables, seq_lens = inputs[:5]
    scale, sliding_window, softcap = inputs.scale, inputs.sliding_window, inputs.softcap
    starts, q_lens, lens = _check_values(inputs)
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    tables = block_tables.long()
    dev = q.device
    # Blocks a window of W positions can touch: W - 1 positions before the query's own.
    window_blocks = None if sliding_window is None else -(-(sliding_window - 1) // block_size) + 1

    # Decode sequences, longest first, in chunks that each pad only to their own longest
    # context: ragged lengths (the normal case) would otherwise pay for the longest everywhere.
    decode = sorted((s for s, n in enumerate(q_lens) if n == 1), key=lambda s: -lens[s])
    token_bytes = num_kv_heads * head_dim * 4
    for i, end, num_blocks in decode_chunks(
        [lens[s] for s in decode], block_size, token_bytes, window_blocks
    ):
        padded = num_blocks * block_size
        chunk_seqs = decode[i:end]
        seqs = torch.tensor(chunk_seqs, device=dev)
        rws = torch.tensor([starts[s] for s in chunk_seqs], device=dev)
        # Each sequence's gathered range starts at block `first` (0 without a window):
        # [n, num_blocks] table columns and [n, padded] absolute positions.
        last = (seq_lens[seqs].long() - 1) // block_size
        first = (last - num_blocks + 1).clamp(min=0)
        cols = first[:, None] + torch.arange(num_blocks, device=dev)
        k = _gather(k_cache, tables[seqs[:, None], cols])  # [n, padded, kv_heads, D]
        v = _gather(v_cache, tables[seqs[:, None], cols])
        pos = first[:, None] * block_size + torch.arange(padded, device=dev)
        visible = pos < seq_lens[seqs, None]  # [n, padded]
        if sliding_window is not None:
            visible &= pos >= seq_lens[seqs, None] - sliding_window
        if not finite_cache:
            # Slots past a sequence's end hold whatever the pool held (torch.empty bits, NaN
            # included): zero them, or a masked-out NaN leaks through (SDPA adds the mask to
            # NaN scores, and 0 * NaN in P @ V).
            hidden = (~visible).flatten().nonzero().squeeze(1)
            k.view(-1, num_kv_heads, head_dim).index_fill_(0, hidden, 0.0)
            v.view(-1, num_kv_heads, head_dim).index_fill_(0, hidden, 0.0)
        o = attend_decode(
            q[rws].float(),  # [n, heads, D]
            k.float().transpose(1, 2),  # [n, kv_heads, padded, D]
            v.float().transpose(1, 2),
            visible[:, None, None, :],
            scale,
            softcap,
        )  # [n, heads, D]
        out[rws] = o.to(q.dtype)

    for s, n in enumerate(q_lens):
        if n == 1:
            continue
        length, start = lens[s], starts[s]
        # Keys from the block of the first query's first visible position (0 without a window).
        lo = 0 if sliding_window is None else max(0, length - n - sliding_window + 1)
        lo -= lo % block_size
        blocks = tables[s : s + 1, lo // block_size : -(-length // block_size)]
        k = _gather(k_cache, blocks)[0, : length - lo].float().transpose(0, 1)  # [kv, L, D]
        v = _gather(v_cache, blocks)[0, : length - lo].float().transpose(0, 1)
        qs = q[start : start + n].float().transpose(0, 1)  # [heads, n, D]
        mask = None
        if length != n or sliding_window is not None:
            # Query i sits at position length - n + i, after the cached prefix.
            key_pos = torch.arange(lo, length, device=dev)
            query_pos = torch.arange(length - n, length, device=dev)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, L]
            if sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        o = _attend(qs[None], k[None], v[None], mask, scale, softcap)
        out[start : start + n] = o[0].transpose(0, 1).to(q.dtype)
    return out
