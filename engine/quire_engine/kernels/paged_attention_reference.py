"""The torch reference of paged attention: the semantics of the Triton kernel
(:mod:`.paged_attention_triton`) in plain torch, fp32 math, and the engine's CPU path.

The call's layout and checks are :mod:`.paged_attention_inputs`. The decode helpers here
(:func:`decode_chunks`, the rule that cuts a decode batch into chunks, and :func:`attend_decode`,
one-token queries over gathered contexts) are shared with the CPU attention planner
(``quire_engine.cpu.paged_attention``), which replays this reference's work once per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from quire_engine.kernels.kv_quant import dequantize
from quire_engine.kernels.paged_attention_inputs import (
    PagedAttentionInputs,
    check_inputs,
    check_values,
)

_DECODE_CHUNK_BYTES = 2 << 20  # fp32 bytes of gathered K per batched SDPA call (decode_chunks)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of a pool: cache ``[num_blocks, block_size, kv_heads, D]``, blocks
    int64 ``[n, nb]`` -> ``[n, nb * block_size, kv_heads, D]``, contiguous."""
    n, nb = blocks.shape
    gathered = torch.index_select(cache, 0, blocks.flatten())  # faster than cache[blocks] on CPU
    return gathered.view(n, nb * cache.shape[1], *cache.shape[2:])


def _gather_float(
    cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor
) -> torch.Tensor:
    """``_gather`` in float32, dequantizing an 8-bit pool's blocks with their scales as they are
    gathered (the pool itself stays 8-bit)."""
    if scale is None:
        return _gather(cache, blocks).float()
    return dequantize(_gather(cache, blocks), _gather(scale, blocks))


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
    """The Triton launcher's semantics (``paged_attention``) in plain torch, fp32 math: the CPU
    path.

    ``finite_cache=True`` promises that every slot of the pools holds finite values (the engine
    zero-initialises its caches and only writes model K/V into them), which skips zeroing the
    V slots past each sequence's end or before its window.

    Decode sequences (one query token) run batched: their blocks are gathered into a padded
    ``[n, padded_len, kv_heads, D]`` context, masked by length, in one attention call per chunk of
    sequences. Sequences with several query tokens run one by one, with a causal mask shifted
    by their cached prefix. With a sliding window only the blocks that hold a visible position
    are gathered, so the cost follows the window, not the context.
    """
    check_inputs(inputs)
    q, k_cache, v_cache, block_tables, seq_lens = inputs[:5]
    scale, sliding_window, softcap = inputs.scale, inputs.sliding_window, inputs.softcap
    k_scale, v_scale = inputs.k_scale, inputs.v_scale
    starts, q_lens, lens = check_values(inputs)
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
        k = _gather_float(k_cache, k_scale, tables[seqs[:, None], cols])  # [n, padded, kv, D]
        v = _gather_float(v_cache, v_scale, tables[seqs[:, None], cols])
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
            k.transpose(1, 2),  # [n, kv_heads, padded, D]
            v.transpose(1, 2),
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
        k = _gather_float(k_cache, k_scale, blocks)[0, : length - lo].transpose(0, 1)  # [kv, L, D]
        v = _gather_float(v_cache, v_scale, blocks)[0, : length - lo].transpose(0, 1)
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
