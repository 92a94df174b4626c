"""The Triton kernel of causal attention over a paged KV cache (prefill, prefill with a cached
prefix, chunked prefill and decode in one code path) and its launcher.

The call's layout and checks are :mod:`.paged_attention_inputs`; the torch reference with the
same semantics, which is also the engine's CPU path, is :mod:`.paged_attention_reference`.

Kernel plan (flash-decoding). Stage 1 runs one program per (sequence, block of ``BLOCK_Q`` query
tokens, KV head, split). The ``group = num_heads // num_kv_heads`` query heads that share a KV
head are packed into the rows of one tile (row ``r`` = query token ``r // GROUP_PAD``, head
``r % GROUP_PAD``), so Q·Kᵀ is a ``tl.dot`` of at least 16 rows even at decode time, and each
K/V tile is loaded once for the whole group. A split walks its share of the context in tiles of
``BLOCK_N`` positions with an online softmax in fp32. With one split the program writes the final
output; with several it writes a partial output and its log-sum-exp, and stage 2 merges them.
Splits keep the GPU busy when there are few (sequence, KV head) pairs and long contexts.

8-bit caches (``kv_quant``; the constexpr ``KV8``): the K/V tiles are loaded as int8 / fp8 with
their per-token scales ``[BLOCK_N]`` and dequantized after the load, exactly up to fp32
rounding: every 8-bit value converts exactly to q's dtype, the K scale multiplies its column of
scores, the V scale its column of P (or, for fp16 queries, the V tile). q and the output stay in
the model's dtype; the 16- and 32-bit paths compile as before.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from quire_engine.kernels.paged_attention_inputs import (
    PagedAttentionInputs,
    check_inputs,
    check_values,
)
from quire_engine.kernels.triton_runtime import HAS_TRITON, check_launchable, jit

if HAS_TRITON:
    import triton.language as tl

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E) if HAS_TRITON else _LOG2E  # the same, as a kernel constant
_MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves
_MAX_SPLITS = 32


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
    k_scale_ptr,  # fp32 [num_blocks, block_size, num_kv_heads]: 8-bit caches (KV8) only
    v_scale_ptr,  # same layout as k_scale
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    window,  # sliding window W (positions p - W < pos <= p are visible); unused without HAS_WINDOW
    softcap,  # logit soft-cap c; unused without HAS_SOFTCAP
    stride_qt, stride_qh,  # q: token, head
    stride_kb, stride_kt, stride_kh,  # k_cache: block, slot, head
    stride_vb, stride_vt, stride_vh,  # v_cache
    stride_ksb, stride_kst, stride_ksh,  # k_scale: block, slot, head (KV8 only)
    stride_vsb, stride_vst, stride_vsh,  # v_scale
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
    KV8: tl.constexpr,  # 8-bit caches: dequantize each tile with its per-token scales
    V_SCALE_ON_P: tl.constexpr,  # KV8: scale P's columns (bf16, fp32) or the V tile (fp16)
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
        if KV8:
            # int8 and both fp8 formats convert exactly to q's dtype, so q . k8 is exact up to
            # the dot's fp32 accumulation, and the key's scale factors out of its column of
            # scores: s[:, n] = (q . k8[n]) * k_scale[n]. Masked positions get scale 0.
            k_s = tl.load(
                k_scale_ptr + block * stride_ksb + slot * stride_kst + kv_head * stride_ksh,
                mask=pos_ok,
                other=0.0,
            )  # [BLOCK_N]
            s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
            s = s * (k_s * scale_log2)[None, :]  # [BLOCK_M, BLOCK_N]
        else:
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
        if KV8:
            v_s = tl.load(
                v_scale_ptr + block * stride_vsb + slot * stride_vst + kv_head * stride_vsh,
                mask=pos_ok,
                other=0.0,
            )  # [BLOCK_N]
            if V_SCALE_ON_P:
                # sum_n p[:, n] * v_scale[n] * v8[n]: the scale goes on P's column n, which in
                # bf16 or fp32 (fp32's exponent range) rounds like p itself; v8 stays exact.
                p_v = (p * v_s[None, :]).to(q.dtype)
                v = v.to(q.dtype)
            else:
                # fp16: p * v_scale would sink into fp16's subnormals (e5m2 scales are amax /
                # 57344), so dequantize the tile instead: v8 * v_scale rounds once to fp16.
                p_v = p.to(q.dtype)
                v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        else:
            p_v = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
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
    *,
    kv8: bool = False,
) -> dict[str, Any]:
    """Constexprs (all but NUM_SPLITS, HAS_WINDOW, HAS_SOFTCAP) and ``num_warps`` of the stage-1
    kernel for queries of ``dtype``; ``kv8``: over 8-bit caches (same tiles: an 8-bit tile is
    converted to ``dtype`` before its dot).

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
        "KV8": kv8,
        "V_SCALE_ON_P": dtype != torch.float16,
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


def paged_attention(inputs: PagedAttentionInputs, *, num_splits: int | None = None) -> torch.Tensor:
    """Run the Triton kernel; returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    ``inputs.max_query_len`` and ``inputs.max_seq_len`` must bound the true lengths (they size
    the grid and the split count; on CUDA they are trusted, as checking would cost a host sync).
    ``num_splits`` defaults to :func:`choose_num_splits`. ``sliding_window`` and ``softcap``: see
    :mod:`.paged_attention_inputs`.
    """
    check_inputs(inputs)
    (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
     max_seq_len, sliding_window, softcap, k_scale, v_scale) = inputs  # fmt: skip
    if q.device.type == "cpu":
        check_values(inputs)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    check_launchable(q.device, "paged_attention")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out

    kv8 = False
    scale_strides: tuple[int, ...] = (0,) * 6  # unused without KV8
    if k_scale is not None and v_scale is not None:  # check_inputs: both or neither
        kv8, scale_strides = True, (*k_scale.stride(), *v_scale.stride())  # 2 x (block, slot, head)
    config = _stage1_config(
        q.dtype, num_heads, num_kv_heads, head_dim, block_size, max_query_len, kv8=kv8
    )
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
        q, k_cache, v_cache, part, lse, block_tables, seq_lens, query_start_loc, k_scale, v_scale,
        float(scale) * _LOG2E,
        sliding_window or 0,
        float(softcap or 0.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
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
