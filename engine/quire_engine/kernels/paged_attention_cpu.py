"""The engine's CPU attention path: ``paged_attention_reference``'s semantics, planned once per
step and replayed by every layer.

Every layer of a step sees the same block tables, lengths and query layout; only q, K and V
differ. ``paged_attention_reference`` (the oracle the tests compare kernels with) recomputes the
decode ordering, the chunking, the index tensors and the masks, and checks the metadata on the
host, in every layer. ``CpuAttentionPlan.build`` does that work once per step from the runner's
host arrays; ``write_kv`` and ``attend`` then cost the tensor work and a few calls per chunk.

Semantics are the reference's (``finite_cache=True``: the runner zero-initialises its pools and
writes only model K/V into them):

* decode sequences (one query token), longest first, in chunks whose gathered K stays near
  ``_DECODE_CHUNK_BYTES`` and whose contexts are at least half the chunk's padded length; one
  SDPA call per chunk over the gathered ``[n, padded, kv_heads, D]`` context, masked by length;
* sequences with several query tokens one by one, with a causal mask shifted by their cached
  prefix.

The plan trusts its inputs (the runner built them from the scheduler's output); external callers
use ``paged_attention_reference``, which checks them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from quire_engine.kernels.paged_attention import _DECODE_CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class _DecodeChunk:
    rows: torch.Tensor  # int64 [n]: the query/output row of each sequence
    blocks: torch.Tensor  # int64 [n * num_blocks]: the chunk's block ids, row-major
    num_seqs: int
    padded: int  # num_blocks * block_size
    mask: torch.Tensor  # bool [n, 1, 1, padded]: visible keys


@dataclass(frozen=True, slots=True)
class _Prefill:
    start: int  # first query row
    num_queries: int
    length: int  # context length including the queries
    blocks: torch.Tensor  # int64 [ceil(length / block_size)]
    mask: torch.Tensor | None  # bool [num_queries, length]; None: plain causal (no prefix)


class CpuAttentionPlan:
    """One step's attention work on CPU, shared by every layer (see the module docstring)."""

    def __init__(
        self,
        slots: torch.Tensor,
        decode: list[_DecodeChunk],
        prefill: list[_Prefill],
        block_size: int,
    ) -> None:
        self.slots = slots  # int64 [T]: flat slot of each new token
        self.decode = decode
        self.prefill = prefill
        self.block_size = block_size

    @classmethod
    def build(
        cls,
        *,
        slots: np.ndarray,  # int64 [T]
        block_tables: np.ndarray,  # int32 [S, max_blocks]
        seq_lens: np.ndarray,  # [S]: context length including the step's tokens
        query_start_loc: np.ndarray,  # [S + 1]
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> CpuAttentionPlan:
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(starts)]
        tables = torch.from_numpy(block_tables).long()  # [S, max_blocks]
        token_bytes = num_kv_heads * head_dim * 4

        decode_chunks: list[_DecodeChunk] = []
        order = sorted((s for s, n in enumerate(q_lens) if n == 1), key=lambda s: -lens[s])
        i = 0
        while i < len(order):
            num_blocks = -(-lens[order[i]] // block_size)
            padded = num_blocks * block_size
            end = i + 1
            limit = max(1, _DECODE_CHUNK_BYTES // (padded * token_bytes))
            while end < len(order) and end - i < limit and 2 * lens[order[end]] > padded:
                end += 1
            chunk = order[i:end]
            i = end
            index = torch.tensor(chunk)
            chunk_lens = torch.tensor([lens[s] for s in chunk])
            # Always a mask, even when every key is visible: the reference passes one, and SDPA
            # may take another kernel without it (results equal only to rounding).
            mask = (torch.arange(padded) < chunk_lens[:, None])[:, None, None, :]
            decode_chunks.append(
                _DecodeChunk(
                    rows=torch.tensor([starts[s] for s in chunk]),
                    blocks=tables[index, :num_blocks].flatten(),
                    num_seqs=len(chunk),
                    padded=padded,
                    mask=mask,
                )
            )

        prefill: list[_Prefill] = []
        for s, n in enumerate(q_lens):
            if n == 1:
                continue
            length = lens[s]
            causal: torch.Tensor | None = None
            if length != n:  # query i sits at position length - n + i, after the cached prefix
                key_pos = torch.arange(length)
                query_pos = torch.arange(length - n, length)
                causal = key_pos[None, :] <= query_pos[:, None]  # [n, L]
            prefill.append(
                _Prefill(starts[s], n, length, tables[s, : -(-length // block_size)], causal)
            )
        return cls(torch.from_numpy(slots), decode_chunks, prefill, block_size)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, kv_heads, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D], contiguous
        v_cache: torch.Tensor,
    ) -> None:
        """The step's new K/V into their slots (the runner's pools are contiguous, so a flat
        ``[num_blocks * block_size, kv_heads, D]`` view indexes slots directly)."""
        flat = (-1, *k_cache.shape[2:])
        k_cache.view(flat).index_copy_(0, self.slots, key.to(k_cache.dtype))
        v_cache.view(flat).index_copy_(0, self.slots, value.to(v_cache.dtype))

    def attend(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``[T, heads, D]`` in ``q.dtype``; K/V of the step must be written first."""
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        for c in self.decode:
            k = torch.index_select(k_cache, 0, c.blocks).view(c.num_seqs, c.padded, kv_heads, -1)
            v = torch.index_select(v_cache, 0, c.blocks).view(c.num_seqs, c.padded, kv_heads, -1)
            o = F.scaled_dot_product_attention(
                q.index_select(0, c.rows).float().unsqueeze(2),  # [n, heads, 1, D]
                k.float().transpose(1, 2),  # [n, kv_heads, padded, D]
                v.float().transpose(1, 2),
                attn_mask=c.mask,
                scale=scale,
                enable_gqa=True,
            )  # [n, heads, 1, D]
            out.index_copy_(0, c.rows, o.squeeze(2).to(q.dtype))
        for p in self.prefill:
            k = torch.index_select(k_cache, 0, p.blocks).view(-1, kv_heads, head_dim)
            v = torch.index_select(v_cache, 0, p.blocks).view(-1, kv_heads, head_dim)
            k = k[: p.length].float().transpose(0, 1)  # [kv_heads, L, D]
            v = v[: p.length].float().transpose(0, 1)
            qs = q[p.start : p.start + p.num_queries].float().transpose(0, 1)  # [heads, n, D]
            o = F.scaled_dot_product_attention(
                qs[None], k[None], v[None], attn_mask=p.mask, is_causal=p.mask is None,
                scale=scale, enable_gqa=True,
            )  # fmt: skip
            out[p.start : p.start + p.num_queries] = o[0].transpose(0, 1).to(q.dtype)
        return out
