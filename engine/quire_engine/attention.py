"""The attention call transformers models make inside Quire (tensor side, driven by the runner).

Registered under the name ``"quire"`` with transformers' ``AttentionInterface``. The model runner
packs every sequence of a step into one row ``input_ids`` [1, T] and passes an
``AttentionMetadata`` as the extra keyword ``quire_metadata``; transformers forwards it, after
projecting and rotating q/k, to ``paged_attention_forward`` once per layer. There the new K/V are
written into the paged cache at ``slot_mapping`` and attention reads each sequence's blocks through
its block table: the Triton kernel on CUDA, the batched torch reference on CPU.

The mask function registered with it returns None: causality and sequence boundaries come from the
metadata, so no [T, T] mask is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from quire_engine.kernels.kv_cache_ops import write_kv
from quire_engine.kernels.paged_attention import paged_attention, paged_attention_reference
from quire_engine.kernels.paged_attention_cpu import LazyCpuAttentionPlan

ATTENTION_NAME = "quire"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's view of the paged cache, shared by every layer."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: 2 x [blocks, bs, kv_heads, D]
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative new-token counts
    max_query_len: int
    max_seq_len: int
    use_triton: bool
    # CPU only: the step's attention work planned once for every layer (None: the reference).
    cpu_plan: LazyCpuAttentionPlan | None = None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, D], after RoPE
    key: torch.Tensor,  # [1, kv_heads, T, D], after RoPE
    value: torch.Tensor,  # [1, kv_heads, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    quire_metadata: AttentionMetadata | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    md = quire_metadata
    if md is None:
        raise ValueError("the quire attention needs quire_metadata (call through ModelRunner)")
    k_cache, v_cache = md.kv_caches[module.layer_idx]  # type: ignore[index]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if md.cpu_plan is not None:
        plan = md.cpu_plan.get()
        plan.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache)
        out = plan.attend(query[0].transpose(0, 1), k_cache, v_cache, scale)
        return out.unsqueeze(0), None  # [1, T, heads, D]
    write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, md.slot_mapping)
    q = query[0].transpose(0, 1)  # [T, heads, D]; the kernels need only head_dim contiguous
    args = (q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale)
    if md.use_triton:
        out = paged_attention(*args, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
    else:
        # The runner zero-initialises its pools and writes only model K/V into them.
        out = paged_attention_reference(
            *args, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len, finite_cache=True
        )
    return out.unsqueeze(0), None  # [1, T, heads, D]


def _no_mask(*_: Any, **__: Any) -> None:
    return None


def register() -> None:
    """Idempotent: make ``"quire"`` a valid ``attn_implementation``."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
