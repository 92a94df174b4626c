"""The attention call transformers models make inside Quire (tensor side, driven by the runner).

Registered under the name ``"quire"`` with transformers' ``AttentionInterface``. The model runner
packs every sequence of a step into one row ``input_ids`` [1, T] and passes an
``AttentionMetadata`` as the extra keyword ``quire_metadata``; transformers forwards it, after
projecting and rotating q/k, to ``paged_attention_forward`` once per layer. There the new K/V are
written into the paged cache at ``slot_mapping`` and attention reads each sequence's blocks through
its block table: the Triton kernel on CUDA, the batched torch reference on CPU.

The mask function registered with it returns None: causality and sequence boundaries come from the
metadata, and the per-layer semantics transformers encodes in its masks arrive as keywords of the
call (``sliding_window``, ``softcap``, ``scaling``), so no [T, T] mask is ever built.

What a layer passes is audited once, at load time, by :func:`inspect_layers`: a two-token forward
through a recording attention. A keyword Quire does not know, a dropout, a non-causal layer or a
K/V shape the paged cache does not have is refused there with a ``ValueError`` naming it, never
silently ignored. The per-call function checks the keyword names again (a set difference) so a
model that changes behaviour after loading fails loudly too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from quire_engine.cpu.paged_attention import LazyCpuAttentionPlan
from quire_engine.kernels.kv_cache_ops import write_kv
from quire_engine.kernels.kv_quant import LayerKV
from quire_engine.kernels.paged_attention_inputs import LayerAttention as LayerAttention
from quire_engine.kernels.paged_attention_inputs import PagedAttentionInputs
from quire_engine.kernels.paged_attention_reference import paged_attention_reference
from quire_engine.kernels.paged_attention_triton import paged_attention

# LayerAttention (what one layer's attention call asks for, as inspect_layers observes it) is
# defined with the kernels, as the CPU backend reads it too and imports nothing from this layer;
# re-exported here (``as``) for the loader and the runner.

ATTENTION_NAME = "quire"
PROFILE_NAME = "quire_profile"  # no attention at all: see register_profiling
_PROBE_NAME = "quire_probe"

# Keywords a transformers attention layer passes that Quire may drop, and why each is safe.
IGNORED_KWARGS = {
    "position_ids": "RoPE is applied before the call; cache positions come from the metadata",
    "use_cache": "transformers' own KV cache is off; the paged cache is Quire's",
    "output_router_logits": "an MoE flag of the decoder layer, not of attention",
}
# Keywords honoured by paged_attention_forward (dropout only at 0.0: inference).
HONOURED_KWARGS = ("scaling", "sliding_window", "softcap", "dropout", "quire_metadata")


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's view of the paged cache, shared by every layer."""

    kv_caches: list[LayerKV]  # per layer: K/V [blocks, bs, kv_heads, D] (+ 8-bit scales)
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative new-token counts
    max_query_len: int
    max_seq_len: int
    use_triton: bool
    # CPU only: the step's attention work planned once for every layer (None: the reference).
    cpu_plan: LazyCpuAttentionPlan | None = None


_KNOWN_KWARGS = frozenset(IGNORED_KWARGS) | frozenset(HONOURED_KWARGS)  # built once: per layer


def _unknown(kwargs: dict[str, Any]) -> set[str]:
    return kwargs.keys() - _KNOWN_KWARGS


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, D], after RoPE
    key: torch.Tensor,  # [1, kv_heads, T, D], after RoPE
    value: torch.Tensor,  # [1, kv_heads, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    quire_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    md = quire_metadata
    if md is None:
        raise ValueError("the quire attention needs quire_metadata (call through ModelRunner)")
    if kwargs and (unknown := _unknown(kwargs)):
        raise ValueError(f"attention keywords Quire cannot honour: {sorted(unknown)}")
    if dropout:
        raise ValueError(f"attention dropout {dropout} in inference: call model.eval()")
    layer: LayerKV = md.kv_caches[module.layer_idx]  # type: ignore[index]
    k_cache, v_cache, k_scale, v_scale, fixed = layer
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window is not None else None
    cap = float(softcap) if softcap is not None else None
    # The planned CPU path: plain causal layers always; windowed or soft-capped layers (and the
    # released blocks of windowed models) only in steps it runs wholly through the native decode
    # kernel, which honours both. Otherwise the reference, which honours both everywhere.
    if md.cpu_plan is not None and (plan := md.cpu_plan.get()).handles(window, cap):
        plan.write_kv(
            key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, k_scale, v_scale,
            fixed,
        )  # fmt: skip
        out = plan.attend(
            query[0].transpose(0, 1), k_cache, v_cache, scale, window, cap, k_scale, v_scale
        )
        return out.unsqueeze(0), None  # [1, T, heads, D]
    write_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, md.slot_mapping,
        k_scale=k_scale, v_scale=v_scale, fixed=fixed,
    )  # fmt: skip
    q = query[0].transpose(0, 1)  # [T, heads, D]; the kernels need only head_dim contiguous
    inputs = PagedAttentionInputs(
        q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
        md.max_query_len, md.max_seq_len, window, cap, k_scale, v_scale,
    )  # fmt: skip
    if md.use_triton:
        out = paged_attention(inputs)
    else:
        # The runner zero-initialises its pools and writes only model K/V into them.
        out = paged_attention_reference(inputs, finite_cache=True)
    return out.unsqueeze(0), None  # [1, T, heads, D]


def _no_mask(*_: Any, **__: Any) -> None:
    return None


def register() -> None:
    """Idempotent: make ``"quire"`` a valid ``attn_implementation``.

    No mask function is registered for it, on purpose: transformers then skips mask creation
    altogether (the paged attention masks by block tables and lengths), including its
    packed-sequence detection over ``position_ids`` and a CUDA-graph-capture query, which
    otherwise run at every forward (7 % of the engine thread serving a small model at
    concurrency 128). The equivalence suite covers every supported architecture this way."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def _zero_output(query: torch.Tensor) -> torch.Tensor:
    """An attention output of the right shape: [B, T, heads, D] for query [B, heads, T, D]."""
    b, heads, t, d = query.shape
    return query.new_zeros(b, t, heads, d)


def _zero_attention(
    module: torch.nn.Module, query: torch.Tensor, *_: Any, **__: Any
) -> tuple[torch.Tensor, None]:
    return _zero_output(query), None


def register_profiling() -> str:
    """Register (idempotent) and return ``PROFILE_NAME``: an attention that outputs zeros and
    builds no mask, for measuring the activation peak of everything but attention (the paged
    kernels never hold a [T, T] score matrix). Works for every architecture, including those
    transformers runs only with eager attention (Gemma 2)."""
    AttentionInterface.register(PROFILE_NAME, _zero_attention)
    AttentionMaskInterface.register(PROFILE_NAME, _no_mask)
    return PROFILE_NAME


def inspect_layers(
    model: PreTrainedModel, num_kv_heads: int, head_dim: int
) -> list[LayerAttention]:
    """Run a two-token forward through a recording attention and return every layer's request,
    in layer order; ``ValueError`` for anything the paged attention cannot honour.

    Checked: every keyword is honoured or known to be safe to drop (``IGNORED_KWARGS``); dropout
    is 0; the layer is causal; K and V have ``num_kv_heads`` heads of ``head_dim`` (the paged
    cache's shape) and Q the same head size; every layer index in ``range(num_hidden_layers)``
    calls attention exactly once."""
    calls: dict[int, LayerAttention] = {}
    problems: list[str] = []

    def record(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        idx = getattr(module, "layer_idx", None)
        where = f"layer {idx} ({type(module).__name__})"
        if not isinstance(idx, int) or idx in calls:
            problems.append(f"{where}: no distinct layer_idx to index the paged cache with")
        if _unknown(kwargs):
            problems.append(f"{where}: passes attention keywords {sorted(_unknown(kwargs))}")
        if kwargs.get("dropout"):
            problems.append(f"{where}: attention dropout {kwargs['dropout']} (not in eval mode)")
        if getattr(module, "is_causal", True) is not True:
            problems.append(f"{where}: non-causal (bidirectional) attention")
        shapes = (key.shape[1], key.shape[3], value.shape[1], value.shape[3], query.shape[3])
        if shapes != (num_kv_heads, head_dim, num_kv_heads, head_dim, head_dim):
            problems.append(
                f"{where}: K/V heads x dim {tuple(key.shape[1::2])}/{tuple(value.shape[1::2])} "
                f"and query dim {query.shape[3]}, but the cache is {num_kv_heads} x {head_dim}"
            )
        window, cap = kwargs.get("sliding_window"), kwargs.get("softcap")
        scaling = kwargs.get("scaling")
        if isinstance(idx, int):
            calls[idx] = LayerAttention(
                idx,
                int(window) if window is not None else None,
                float(cap) if cap is not None else None,
                float(scaling) if scaling is not None else None,
            )
        return _zero_output(query), None

    AttentionInterface.register(_PROBE_NAME, record)
    AttentionMaskInterface.register(_PROBE_NAME, _no_mask)
    impl = model.config._attn_implementation
    model.set_attn_implementation(_PROBE_NAME)
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device
            ids = torch.zeros((1, 2), dtype=torch.long, device=device)
            model(input_ids=ids, position_ids=torch.arange(2, device=device)[None], use_cache=False)
    finally:
        model.set_attn_implementation(impl)
    num_layers = int(getattr(model.config, "num_hidden_layers", len(calls)))
    if sorted(calls) != list(range(num_layers)):
        problems.append(
            f"attention was called for layers {sorted(calls)}, expected 0..{num_layers - 1}"
        )
    if problems:
        raise ValueError(
            "the model's attention asks for what Quire's paged attention cannot honour: "
            + "; ".join(problems)
        )
    return [calls[i] for i in range(num_layers)]
