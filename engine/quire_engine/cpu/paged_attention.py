"""The engine's CPU attention path: ``paged_attention_reference``'s semantics, planned once per
step and replayed by every layer.

Every layer of a step sees the same block tables, lengths and query layout; only q, K and V
differ. ``paged_attention_reference`` (the oracle the tests compare kernels with) recomputes the
decode ordering, the chunking, the index tensors and the masks, and checks the metadata on the
host, in every layer. ``CpuAttentionPlan.build`` does that work once per step from the runner's
host arrays; ``write_kv`` and ``attend`` then cost the tensor work and a few calls per chunk.

Semantics are the reference's (``finite_cache=True``: the runner zero-initialises its pools and
writes only model K/V into them):

* decode sequences (one query token): with the native kernel (``native.paged_decode``: fp32
  queries, a bf16 model's widened, over fp32, bf16 or 8-bit pools), one C call per layer that
  reads every sequence's blocks in place (a bf16 pool's elements, an 8-bit pool's bytes and
  scales, widened in registers); otherwise longest first, in
  chunks whose gathered K stays near ``_DECODE_CHUNK_BYTES`` and whose contexts are at least
  half the chunk's padded length, one SDPA call per chunk over the gathered
  ``[n, padded, kv_heads, D]`` context, masked by length, with the query heads of each KV head
  as its query rows (no K/V repeated per head);
* sequences with several query tokens one by one, with a causal mask shifted by their cached
  prefix.

Layers with a sliding window or a logit soft-cap are served here only in steps whose every row
is a native decode row (``handles``), through the kernel's window and soft-cap; in other steps
the caller runs the reference for them.

The plan trusts its inputs (the runner built them from the scheduler's output); external callers
use ``paged_attention_reference``, which checks them. Before a native call it still checks that
every block id is inside the pool and every length inside its table row: an index error there
would be a crash, not an exception. The torch path is bit-identical to the reference; the native
kernel equals it to rounding (another summation order), and each sequence's result from it is
independent of the batch around it and of the thread count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from quire_engine.cpu.native import PagedDecode
from quire_engine.kernels.kv_cache_ops import write_kv_reference
from quire_engine.kernels.kv_quant import FixedScales, dequantize
from quire_engine.kernels.paged_attention_reference import attend_decode, decode_chunks


@dataclass(frozen=True, slots=True)
class _DecodeChunk:
    rows: torch.Tensor  # int64 [n]: the query/output row of each sequence
    blocks: torch.Tensor  # int64 [n * num_blocks]: the chunk's block ids, row-major
    num_seqs: int
    padded: int  # num_blocks * block_size
    mask: torch.Tensor  # bool [n, 1, 1, padded]: visible keys


@dataclass(frozen=True, slots=True)
class _NativeDecode:
    kernel: PagedDecode
    rows: np.ndarray  # int64 [n]: the query/output row of each decode sequence
    tables: np.ndarray  # int32 [n, max_blocks], C-contiguous
    lens: np.ndarray  # int64 [n]: context lengths, each in 1 .. max_blocks * block_size
    max_block: int  # the largest block id in tables (checked against the pool once per layer)
    num_threads: int


@dataclass(frozen=True, slots=True)
class _Prefill:
    start: int  # first query row
    num_queries: int
    length: int  # context length including the queries
    blocks: torch.Tensor  # int64 [ceil(length / block_size)]
    mask: torch.Tensor | None  # bool [num_queries, length]; None: plain causal (no prefix)


class CpuAttentionPlan:
    """One step's attention work on CPU, shared by every layer (see the module docstring)."""

    @classmethod
    def lazy(cls, **inputs: Any) -> LazyCpuAttentionPlan:
        """A plan built on first use, i.e. inside the forward pass (``inputs``: those of
        ``build``). Planning is attention work: a step whose forward needs no attention (the
        stand-in forward of ``bench step``) does not pay for it."""
        return LazyCpuAttentionPlan(inputs)

    def __init__(
        self,
        slots: torch.Tensor,
        decode: list[_DecodeChunk],
        prefill: list[_Prefill],
        block_size: int,
        native: _NativeDecode | None = None,
    ) -> None:
        self.slots = slots  # int64 [T]: flat slot of each new token
        self.decode = decode  # SDPA chunks; empty when native decode takes every decode row
        self.native = native
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
        native: PagedDecode | None = None,
        num_threads: int = 1,
    ) -> CpuAttentionPlan:
        """``native``: run decode rows through the native kernel (the runner passes it when
        the pool is one it reads: fp32, bf16 or 8-bit) on up to ``num_threads`` threads."""
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(starts)]
        tables = torch.from_numpy(block_tables).long()  # [S, max_blocks]
        decode = np.flatnonzero(np.diff(query_start_loc) == 1)
        chunks: list[_DecodeChunk] = []
        native_decode = None
        if native is not None:
            native_decode = _native_decode(
                native, decode, block_tables, seq_lens, query_start_loc, block_size, num_threads
            )
        else:
            chunks = _decode_chunks(
                decode, tables, seq_lens, query_start_loc, block_size, num_kv_heads * head_dim * 4
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
        return cls(torch.from_numpy(slots), chunks, prefill, block_size, native_decode)

    def write_kv(
        self,
        key: torch.Tensor,  # [T, kv_heads, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, D], contiguous
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None = None,  # 8-bit pools: fp32 [num_blocks, block_size, kv_heads]
        v_scale: torch.Tensor | None = None,
        fixed: FixedScales | None = None,
    ) -> None:
        """The step's new K/V into their slots (the runner's pools are contiguous, so a flat
        ``[num_blocks * block_size, kv_heads, D]`` view indexes slots directly); an 8-bit pool
        is written quantized, as ``write_kv_reference`` does."""
        if k_scale is not None:
            write_kv_reference(
                key, value, k_cache, v_cache, self.slots, k_scale=k_scale, v_scale=v_scale,
                fixed=fixed,
            )  # fmt: skip
            return
        flat = (-1, *k_cache.shape[2:])
        k_cache.view(flat).index_copy_(0, self.slots, key.to(k_cache.dtype))
        v_cache.view(flat).index_copy_(0, self.slots, value.to(v_cache.dtype))

    def handles(self, sliding_window: int | None, softcap: float | None) -> bool:
        """Whether ``attend`` serves a layer with this window and soft-cap: plain causal layers
        always; windowed or soft-capped ones when every row is a native decode row (the common
        steady state; other steps take the reference, which honours both everywhere)."""
        if sliding_window is None and softcap is None:
            return True
        return self.native is not None and not self.prefill

    def attend(
        self,
        q: torch.Tensor,  # [T, heads, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        k_scale: torch.Tensor | None = None,  # 8-bit pools: their scales (see write_kv)
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, heads, D]`` in ``q.dtype``; K/V of the step must be written first. A window or
        soft-cap only where ``handles`` says so. An 8-bit pool's gathered blocks are
        dequantized as they are gathered (the pool stays 8-bit); the native kernel reads it
        in place."""
        if not self.handles(sliding_window, softcap):
            raise ValueError("this plan's torch path has no sliding window or soft-cap")
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if (nd := self.native) is not None and len(nd.rows):
            if nd.max_block >= k_cache.shape[0]:
                raise ValueError(f"block {nd.max_block} is outside a pool of {k_cache.shape[0]}")
            # The kernel takes and gives fp32 (a bf16 model's queries widen exactly, its
            # outputs round once, as SDPA's do on the torch path).
            wide = q.dtype != torch.float32
            qn = q.float() if wide else q if q.stride(2) == 1 else q.contiguous()
            on = torch.empty(qn.shape, dtype=torch.float32) if wide else out
            nd.kernel(
                qn, k_cache, v_cache, nd.rows, nd.tables, nd.lens, scale, on, nd.num_threads,
                sliding_window, softcap, k_scale, v_scale,
            )  # fmt: skip
            if wide:
                rows = torch.from_numpy(nd.rows)
                out.index_copy_(0, rows, on.index_select(0, rows).to(q.dtype))
        for c in self.decode:
            k = _gather(k_cache, k_scale, c.blocks).view(c.num_seqs, c.padded, kv_heads, -1)
            v = _gather(v_cache, v_scale, c.blocks).view(c.num_seqs, c.padded, kv_heads, -1)
            o = attend_decode(
                q.index_select(0, c.rows).float(),  # [n, heads, D]
                k.transpose(1, 2),  # [n, kv_heads, padded, D]
                v.transpose(1, 2),
                c.mask,  # [n, 1, 1, padded]
                scale,
                None,
            )  # [n, heads, D]
            out.index_copy_(0, c.rows, o.to(q.dtype))
        for p in self.prefill:
            k = _gather(k_cache, k_scale, p.blocks).view(-1, kv_heads, head_dim)
            v = _gather(v_cache, v_scale, p.blocks).view(-1, kv_heads, head_dim)
            k = k[: p.length].transpose(0, 1)  # [kv_heads, L, D]
            v = v[: p.length].transpose(0, 1)
            qs = q[p.start : p.start + p.num_queries].float().transpose(0, 1)  # [heads, n, D]
            o = F.scaled_dot_product_attention(
                qs[None], k[None], v[None], attn_mask=p.mask, is_causal=p.mask is None,
                scale=scale, enable_gqa=True,
            )  # fmt: skip
            out[p.start : p.start + p.num_queries] = o[0].transpose(0, 1).to(q.dtype)
        return out


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """float32 copies of ``blocks`` (int64 [n]) of a pool: ``[n, block_size, kv_heads, D]``,
    dequantized with their scales for an 8-bit pool."""
    gathered = torch.index_select(cache, 0, blocks)
    if scale is None:
        return gathered.float()
    return dequantize(gathered, torch.index_select(scale, 0, blocks))


def _native_decode(
    kernel: PagedDecode,
    decode: np.ndarray,  # int64 [D]: indices of the one-token sequences
    block_tables: np.ndarray,  # int32 [S, max_blocks]
    seq_lens: np.ndarray,  # [S]
    query_start_loc: np.ndarray,  # [S + 1]
    block_size: int,
    num_threads: int,
) -> _NativeDecode:
    tables = np.ascontiguousarray(block_tables[decode], dtype=np.int32)
    rows = query_start_loc[:-1][decode].astype(np.int64)
    lens = seq_lens[decode].astype(np.int64)
    max_block = check_decode_tables(tables, lens, block_size)
    return _NativeDecode(kernel, rows, tables, lens, max_block, num_threads)


def check_decode_tables(tables: np.ndarray, lens: np.ndarray, block_size: int) -> int:
    """The largest block id in ``tables`` [n, W] (0 when empty), for the caller to check
    against its pool; ``ValueError`` for a negative id or a length outside 1 .. W *
    block_size: an index the native kernel would follow out of bounds."""
    if len(lens) and (int(lens.min()) < 1 or int(lens.max()) > tables.shape[1] * block_size):
        raise ValueError(f"decode lengths {lens.tolist()} outside their block tables")
    if tables.size and int(tables.min()) < 0:
        raise ValueError("negative block id in a decode block table")
    return int(tables.max()) if tables.size else 0


def _decode_chunks(
    decode: np.ndarray,  # int64 [D]: indices of the one-token sequences
    tables: torch.Tensor,  # int64 [S, max_blocks]
    seq_lens: np.ndarray,  # [S]
    query_start_loc: np.ndarray,  # [S + 1]
    block_size: int,
    token_bytes: int,
) -> list[_DecodeChunk]:
    # Decode sequences longest first (a stable sort, as the reference's sorted()); the
    # per-chunk tensors are slices of tensors built once for all of them.
    order = decode[np.argsort(-seq_lens[decode], kind="stable")]
    sorted_lens = seq_lens[order].tolist()
    order_t = torch.from_numpy(order)
    rows_all = torch.from_numpy(query_start_loc[:-1][order].astype(np.int64))  # [D]
    tables_all = tables[order_t]  # [D, max_blocks]
    lens_all = torch.from_numpy(seq_lens[order].astype(np.int64))
    chunks: list[_DecodeChunk] = []
    for i, end, num_blocks in decode_chunks(sorted_lens, block_size, token_bytes):
        padded = num_blocks * block_size
        # Always a mask, even when every key is visible: the reference passes one, and SDPA
        # may take another kernel without it (results equal only to rounding).
        mask = torch.arange(padded) < lens_all[i:end, None]  # [n, padded]
        chunks.append(
            _DecodeChunk(
                rows=rows_all[i:end],
                blocks=tables_all[i:end, :num_blocks].flatten(),
                num_seqs=end - i,
                padded=padded,
                mask=mask[:, None, None, :],
            )
        )
    return chunks


class LazyCpuAttentionPlan:
    """Holds ``CpuAttentionPlan.build``'s inputs; the first layer builds the plan, the others
    reuse it."""

    __slots__ = ("_inputs", "_plan")

    def __init__(self, inputs: dict[str, Any]) -> None:
        self._inputs = inputs
        self._plan: CpuAttentionPlan | None = None

    def get(self) -> CpuAttentionPlan:
        if self._plan is None:
            self._plan = CpuAttentionPlan.build(**self._inputs)
        return self._plan
