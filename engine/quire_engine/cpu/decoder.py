"""A decode step of a few sequences of a Llama-shaped model on CPU, in one native call.

At a few rows a decode step streams every weight once and does little arithmetic, and what
the module-by-module forward adds is dispatch: RMSNorm as seven tensor ops, RoPE as eight, SiLU,
residual adds, views and a Python call per module and per op. ``csrc/decoder_decode.c`` runs the
whole stack in one call instead, through the same matmul and attention kernels, and this module
decides when it may (the measured gains are in docs/benchmarks.md).

When: the model is one of ``FAMILIES`` (their decoder layer is transformers' Llama layer:
pre-norm RMSNorm, RoPE over the full head, SiLU-gated MLP, no logit scaling or soft-cap) with
exactly those module classes, fp32 weights that ``linear_cpu`` routes, and every layer's
attention plain or windowed (``attention.LayerAttention``), over fp32 or 8-bit K/V pools
(``--kv-cache-dtype``: the new K/V quantized as they are written, with the layers' fixed
scales when the checkpoint has them); and the step is a pure decode step
(every sequence one new token, every one sampling) of at most ``MAX_ROWS`` sequences.
Anything else takes the module path, unchanged.

What equals what: the attention is the kernel the module path calls (same bits), and so are the
matmuls up to 16 sequences (above, the module path's BLAS differs by rounding); RoPE and the
residual adds are the same float operations in the same order, on cos/sin from the model's own
rotary module (same bits: with fixed frequencies a table over positions from one call of it,
which the kernel reads in place, as vLLM's cos_sin_cache); RMSNorm's sum of squares and SiLU's
exp round differently from torch's. So logits equal the module path's to rounding, in these
steps each row's logits are the same bits whatever other rows share the step (every part is
computed row by row, in an order that depends only on the row; a step with a prefill runs the
modules instead), and the HF equivalence suite, whose decode steps run through here, checks
greedy tokens against transformers' ``generate``. An 8-bit pool's new rows are quantized by
``csrc/kv_quant.c``, ``kv_quant``'s rule bit for bit: the same K/V floats give the module
path's bytes and scales (K/V that differ by rounding may round to a neighbouring 8-bit value).

Ownership: a ``DecoderStack`` reads (never writes) the model's weights and writes each step's
K/V into the runner's pools at its slots, as the module path does. It hands raw addresses to C,
so before each step ``current`` checks that no module of the tree was replaced (a new linear, a
LoRA wrapper), that every weight is where the table says (``model.to``, ``.data =`` move them)
and that the model is in eval mode; if not, the runner rebuilds the stack, or drops it for good
if the model no longer fits. ``decode`` checks every array's shape and every index before the
call: token ids inside the embedding, block ids inside the pool, lengths inside their tables,
slots inside the pool. Forward hooks do not run in a native step, so a model with hooks when
the stack is built is refused (``--profile`` adds its timers later and counts native steps as
their own phase). CPU only: on CUDA the per-op cost
removed here is what CUDA graphs remove.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from quire_engine.cpu import linear as linear_cpu
from quire_engine.cpu.native import KV_KINDS, DecoderArgs, DecoderDecode
from quire_engine.cpu.paged_attention import check_decode_tables
from quire_engine.kernels.kv_quant import FixedScales
from quire_engine.kernels.paged_attention_inputs import LayerAttention

# Causal LM class -> (its model, decoder layer, attention, MLP and RMSNorm classes): checked
# exactly (a subclass may compute something else).
FAMILIES: dict[type, tuple[type, ...]] = {
    LlamaForCausalLM: (
        llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP,
        llama.LlamaRMSNorm,
    ),
    MistralForCausalLM: (
        mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
        mistral.MistralMLP, mistral.MistralRMSNorm,
    ),
    Qwen2ForCausalLM: (
        qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP,
        qwen2.Qwen2RMSNorm,
    ),
}  # fmt: skip

# The most sequences a step may have to run here (also the C code's documented limit). Up to
# linear_cpu.MAX_ROWS (16) the module path calls the same matmul kernel; above it the module
# path's BLAS, whose GEMM overtakes the saved dispatch past this many rows (docs/benchmarks.md).
MAX_ROWS = 64


@dataclass(frozen=True, slots=True)
class _Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int  # logits per row (lm_head rows)
    vocab_rows: int  # embedding rows: every token id must be below it
    eps: float


class DecoderStack:
    """What ``quire_decoder_decode`` needs for one model and one pair of K/V pools, built once
    (``build``); ``decode`` runs one step."""

    def __init__(
        self,
        kernel: DecoderDecode,
        model: Any,  # a model _check accepted
        sources: list[tuple[torch.nn.Module, str]],
        dims: _Dims,
        windows: np.ndarray,
        scales: np.ndarray,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        block_size: int,
        k_scales: Sequence[torch.Tensor] = (),
        v_scales: Sequence[torch.Tensor] = (),
        fixed: np.ndarray | None = None,
    ) -> None:
        self.kernel = kernel
        self.model = model  # the runner drives this stack only while it drives this model
        # (module, attribute) of every weight whose address is in the table, in table order:
        # read again before each step (a module's weight may have been replaced since).
        self._sources = sources
        self._addresses = _addresses(sources)
        # Every parent -> child edge of the module tree: a module replaced since (a new linear,
        # a LoRA wrapper, another rotary) must not run with the old one's weights.
        self._edges = _edges(model)
        self.dims = dims
        self.windows = windows  # int64 [L], 0: none
        self.scales = scales  # float32 [L]
        # The pools and an 8-bit pool's scales, kept alive with their addresses.
        self._caches = (list(k_caches), list(v_caches), list(k_scales), list(v_scales))
        self.kv_dtype = k_caches[0].dtype
        self.fixed = fixed  # float32 [L, 2]: an 8-bit pool's fixed (K, V) scales; None: dynamic
        self.num_blocks = int(k_caches[0].shape[0])
        self.block_size = block_size
        num_layers = len(windows)
        fields = DecoderDecode.LAYER_FIELDS
        per_layer = len(fields) - 4  # the table's last four fields: the pools and their scales
        assert fields[per_layer:] == ("k_cache", "v_cache", "k_scale", "v_scale")
        table = np.zeros((num_layers, len(fields)), dtype=np.int64)
        table[:, :per_layer] = np.array(self._addresses[: num_layers * per_layer]).reshape(
            num_layers, per_layer
        )
        table[:, per_layer] = [k.data_ptr() for k in k_caches]
        table[:, per_layer + 1] = [v.data_ptr() for v in v_caches]
        if k_scales:  # else 0: a float32 pool has none
            table[:, per_layer + 2] = [k.data_ptr() for k in k_scales]
            table[:, per_layer + 3] = [v.data_ptr() for v in v_scales]
        self._table = table
        embed, norm, lm_head, lm_bias = self._addresses[num_layers * per_layer :]
        # The call's arguments: the model's here, once; the step's set by each decode.
        self._args = DecoderArgs(
            layers=table.ctypes.data, layer_fields=len(fields), num_layers=num_layers,
            windows=windows.ctypes.data, scales=scales.ctypes.data, embed=embed,
            final_norm=norm, lm_head=lm_head, lm_bias=lm_bias or None, vocab=dims.vocab,
            hidden=dims.hidden, heads=dims.heads, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
            inter=dims.inter, eps=dims.eps, block_size=block_size, kv_kind=KV_KINDS[self.kv_dtype],
            kv_fixed=None if fixed is None else fixed.ctypes.data,
        )  # fmt: skip
        self._rotary = model.model.rotary_emb  # checked by _check
        # cos/sin of positions [0, rows), [rows, head_dim] each, from the rotary module's own
        # forward (grown on demand; None until the first step): vLLM's cos_sin_cache. Only for
        # RoPE whose frequencies are fixed at init ("dynamic" and "longrope" recompute them from
        # the largest position of each call, so those are asked every step).
        rope_type = getattr(self._rotary, "rope_type", None)
        self._rope_static = isinstance(rope_type, str) and rope_type not in _DYNAMIC_ROPE
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        layers: Sequence[LayerAttention],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        block_size: int,
        kernel: DecoderDecode,
        k_scales: Sequence[torch.Tensor] = (),
        v_scales: Sequence[torch.Tensor] = (),
        fixed: Sequence[FixedScales] | None = None,
    ) -> DecoderStack | str:
        """The stack, or why this model cannot run through it (the runner logs it). An 8-bit
        pool comes with its scale pools (``k_scales``, ``v_scales``: one per layer) and, when
        the checkpoint has them, each layer's ``fixed`` scales (else dynamic ones)."""
        found = _check(model, layers, k_caches, v_caches, block_size)
        if isinstance(found, str):
            return found
        problem = _check_scales(k_caches, k_scales, v_scales, fixed)
        if problem is not None:
            return problem
        fixed_table = None
        if fixed is not None:
            fixed_table = np.array([[f.k, f.v] for f in fixed], dtype=np.float32)
        sources, dims = found
        windows = np.array([layer.sliding_window or 0 for layer in layers], dtype=np.int64)
        scales = np.array(
            [dims.head_dim**-0.5 if a.scaling is None else a.scaling for a in layers],
            dtype=np.float32,
        )
        return cls(
            kernel, model, sources, dims, windows, scales, k_caches, v_caches, block_size,
            k_scales, v_scales, fixed_table,
        )  # fmt: skip

    def current(self) -> bool:
        """Whether the model is still the one the table describes: the same modules (one
        identity check per edge of its tree), every weight where the table says (one address
        read each), in eval mode."""
        return (
            not self.model.training
            and all(parent._modules.get(name) is child for parent, name, child in self._edges)
            and _addresses(self._sources) == self._addresses
        )

    def decode(
        self,
        input_ids: np.ndarray,  # int64 [n]
        positions: np.ndarray,  # int64 [n]: each token's position (its sequence's length - 1)
        slots: np.ndarray,  # int64 [n]
        tables: np.ndarray,  # int32 [n, W], C-contiguous
        seq_lens: np.ndarray,  # int64 [n]: context length including the token
    ) -> torch.Tensor:
        """float32 logits ``[n, vocab]``; writes the step's K/V into the pools (quantized into
        an 8-bit pool, its scales beside). ``ValueError``
        for an index outside the model or the pool (nothing is written then)."""
        d = self.dims
        n = len(input_ids)
        if not 0 < n <= MAX_ROWS:
            raise ValueError(f"the native decoder takes 1..{MAX_ROWS} sequences, got {n}")
        if any(a.shape != (n,) for a in (input_ids, positions, slots, seq_lens)):
            raise ValueError(f"ids, positions, slots and lengths must each be [{n}]")
        if tables.ndim != 2 or tables.shape[0] != n or tables.shape[1] < 1:
            raise ValueError(f"block tables must be [{n}, W >= 1], got {tables.shape}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= d.vocab_rows:
            raise ValueError(f"token ids outside the embedding's {d.vocab_rows} rows")
        if check_decode_tables(tables, seq_lens, self.block_size) >= self.num_blocks:
            raise ValueError(f"a block id outside the pool of {self.num_blocks} blocks")
        if int(slots.min()) < 0 or int(slots.max()) >= self.num_blocks * self.block_size:
            raise ValueError("a K/V slot outside the pool")
        if not np.array_equal(positions, seq_lens - 1):
            raise ValueError("a decode token must sit at its sequence's last position")
        cos, sin, rope_rows = self._cos_sin(np.ascontiguousarray(positions, dtype=np.int64))
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        lens = np.ascontiguousarray(seq_lens, dtype=np.int64)
        slot = np.ascontiguousarray(slots, dtype=np.int64)
        tab = np.ascontiguousarray(tables, dtype=np.int32)
        logits = torch.empty((n, d.vocab), dtype=torch.float32)
        args = self._args  # the model's fields were set by __init__; the step's here
        args.n = n
        args.ids = ids.ctypes.data
        args.cos, args.sin = cos.data_ptr(), sin.data_ptr()
        args.rope_rows = rope_rows.ctypes.data
        args.slots = slot.ctypes.data
        args.tables, args.table_stride = tab.ctypes.data, tab.shape[1]
        args.lens = lens.ctypes.data
        args.logits = logits.data_ptr()
        args.num_threads = torch.get_num_threads()
        self.kernel(args)
        return logits

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """cos and sin ``[rows, head_dim]`` (contiguous) and, per token, its row in them (int64
        ``[n]``) for these positions (int64 ``[n]``, contiguous, checked >= 0 by the caller).

        Each element is ``cos(p * inv_freq[i]) * scaling`` (``sin`` alike), a function of its
        position alone, so a table made by one call of the module over positions ``[0, rows)``
        holds the values a call per step gives, and the kernel reads a token's row in place
        (its row is its position), with no per-step call of the module and no gather."""
        need = int(positions.max()) + 1
        # Past the pool's token count (only a windowed sequence gets there) no table is kept:
        # it stays within 2x the pool's tokens, a row 1/(layers x KV heads) of a pool's row.
        cap = self.num_blocks * self.block_size
        if not self._rope_static or need > cap:
            probe = torch.empty((1, len(positions), 0), dtype=torch.float32)  # dtype/device
            cos, sin = self._rotary(probe, torch.from_numpy(positions)[None])  # [1, n, hd]
            rows = np.arange(len(positions), dtype=np.int64)
            return cos[0].contiguous(), sin[0].contiguous(), rows
        table = self._rope_table
        if table is None or table[0].shape[0] < need:
            # Doubling, in whole multiples of 16 rows (at most cap + 15), so a long sequence
            # rebuilds it O(log length) times.
            have = 0 if table is None else table[0].shape[0]
            rows_wanted = -(-min(max(need, 2 * have, 256), cap) // 16) * 16
            probe = torch.empty((1, rows_wanted, 0), dtype=torch.float32)
            cos, sin = self._rotary(probe, torch.arange(rows_wanted)[None])
            table = self._rope_table = (cos[0].contiguous(), sin[0].contiguous())
        return table[0], table[1], positions


# RoPE types whose forward recomputes the frequencies from the positions of each call.
_DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})


def _addresses(sources: list[tuple[torch.nn.Module, str]]) -> list[int]:
    """The address of each (module, parameter name)'s tensor now; 0 for None (no bias). Read
    from the module's parameter dict, where ``Module.__getattr__`` finds it too, without that
    fallback's cost (it runs once per weight per step)."""
    found = [module._parameters.get(name) for module, name in sources]
    return [0 if t is None else t.data_ptr() for t in found]


def _check(
    model: Any,  # a PreTrainedModel of any family: its attributes are read, and checked, here
    layers: Sequence[LayerAttention],
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_size: int,
) -> tuple[list[tuple[torch.nn.Module, str]], _Dims] | str:
    """Where every weight is, in the table's order (per layer, then embedding, final norm, LM
    head and its bias) and the sizes, or the first reason the model does not fit the native
    decoder."""
    classes = FAMILIES.get(type(model))
    if classes is None:
        return f"{type(model).__name__} is not one of {sorted(c.__name__ for c in FAMILIES)}"
    model_cls, layer_cls, attn_cls, mlp_cls, norm_cls = classes
    cfg: Any = getattr(model, "config", None)
    inner: Any = getattr(model, "model", None)
    if not _exactly(inner, model_cls) or cfg is None:
        return f"the inner model is not a {model_cls.__name__}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r}, not silu"
    if model.training:
        return "the model is in training mode (dropout)"
    hooked = [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        return f"forward hooks on {hooked[:3]}, which a native step would not run"
    blocks = list(inner.layers)
    if len(blocks) != cfg.num_hidden_layers or len(layers) != len(blocks):
        return "the layer count differs between the config, the modules and the attention audit"
    if any(a.softcap is not None for a in layers):
        return "an attention logit soft-cap"
    if len(k_caches) != len(blocks) or len(v_caches) != len(blocks):
        return "one K and one V pool per layer are needed"
    pools = [*k_caches, *v_caches]
    kv_dtype = k_caches[0].dtype if k_caches else torch.float32
    if kv_dtype not in KV_KINDS or any(
        p.dtype != kv_dtype or not p.is_cpu or not p.is_contiguous() for p in pools
    ):
        return "the K/V pools are not contiguous CPU tensors of one fp32 or 8-bit dtype"
    embed = inner.embed_tokens
    if not _exactly(embed, torch.nn.Embedding) or not _exactly(inner.norm, norm_cls):
        return "the embedding or the final norm is not the family's own module"
    if embed.max_norm is not None:
        return "an embedding with max_norm (renormalised at lookup)"
    lm: Any = model.lm_head
    if not (linear_cpu.routed(lm) and linear_cpu.readable(lm.weight, lm.bias)):  # an nn.Linear
        return "the LM head is not a routed fp32 nn.Linear"
    hidden = int(cfg.hidden_size)
    attn0 = blocks[0].self_attn
    head_dim = int(attn0.head_dim)
    heads = attn0.q_proj.out_features // head_dim
    kv_heads = attn0.k_proj.out_features // head_dim
    inter = blocks[0].mlp.gate_proj.out_features
    norms: list[Any] = [inner.norm]
    sources: list[tuple[torch.nn.Module, str]] = []
    for i, block in enumerate(blocks):
        attn, mlp = block.self_attn, block.mlp
        if (type(block), type(attn), type(mlp)) != (layer_cls, attn_cls, mlp_cls):
            return f"layer {i} is not the family's decoder layer, attention and MLP"
        if not _exactly(block.input_layernorm, norm_cls):
            return f"layer {i}'s input norm is not {norm_cls.__name__}"
        if not _exactly(block.post_attention_layernorm, norm_cls):
            return f"layer {i}'s post-attention norm is not {norm_cls.__name__}"
        if not _exactly(mlp.act_fn, SiLUActivation):
            return f"layer {i}'s activation is {type(mlp.act_fn).__name__}, not SiLU"
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(linear_cpu.routed(m) and linear_cpu.readable(m.weight, m.bias) for m in linears):
            return f"layer {i} has a matmul the few-row kernel does not take"
        if not all(_bias_fits(m) for m in linears):
            return f"layer {i} has a bias that is not one value per output"
        shapes = [tuple(m.weight.shape) for m in linears]
        q_w, kv_w = heads * head_dim, kv_heads * head_dim
        want = [(q_w, hidden), (kv_w, hidden), (kv_w, hidden), (hidden, q_w)]
        want += [(inter, hidden), (inter, hidden), (hidden, inter)]
        if shapes != want or int(attn.head_dim) != head_dim:
            return f"layer {i}'s projections {shapes} are not those of layer 0 ({want})"
        norms += [block.input_layernorm, block.post_attention_layernorm]
        # This layer's row of the table, by field name (the pools are added by the stack).
        row = {"input_norm": (block.input_layernorm, "weight")}
        row["post_norm"] = (block.post_attention_layernorm, "weight")
        for field, m in zip(("q", "k", "v", "o", "gate", "up", "down"), linears, strict=True):
            row[field], row[f"{field}_bias"] = (m, "weight"), (m, "bias")
        sources += [row[field] for field in DecoderDecode.LAYER_FIELDS[:-4]]
    eps = {float(m.variance_epsilon) for m in norms}
    if len(eps) != 1:
        return f"the RMSNorms' epsilons differ: {sorted(eps)}"
    weights = [m.weight for m in norms] + [embed.weight]
    if not linear_cpu.readable(*weights) or any(w.shape[-1] != hidden for w in weights):
        return "a norm or the embedding is not a contiguous fp32 CPU tensor of the hidden size"
    if head_dim % 2 or heads % kv_heads:
        return f"head_dim {head_dim} odd or {heads} heads not a multiple of {kv_heads}"
    pool_shape = (int(k_caches[0].shape[0]), block_size, kv_heads, head_dim)
    if any(tuple(p.shape) != pool_shape for p in pools):
        return f"the pools are not all {pool_shape} (blocks, block size, KV heads, head size)"
    cos, _ = inner.rotary_emb(torch.empty((1, 2, 0)), torch.arange(2)[None])
    if tuple(cos.shape) != (1, 2, head_dim) or cos.dtype != torch.float32:
        return f"the rotary embedding gives {tuple(cos.shape)}, not (1, 2, {head_dim}) fp32"
    if tuple(lm.weight.shape[1:]) != (hidden,) or not _bias_fits(lm):
        return "the LM head does not take the hidden size, or its bias does not fit"
    sources += [(embed, "weight"), (inner.norm, "weight"), (lm, "weight"), (lm, "bias")]
    vocab, vocab_rows = int(lm.weight.shape[0]), int(embed.weight.shape[0])
    return sources, _Dims(hidden, heads, kv_heads, head_dim, inter, vocab, vocab_rows, eps.pop())


def _check_scales(
    k_caches: Sequence[torch.Tensor],
    k_scales: Sequence[torch.Tensor],
    v_scales: Sequence[torch.Tensor],
    fixed: Sequence[FixedScales] | None,
) -> str | None:
    """Why the scale pools (and fixed scales) do not fit the pools ``_check`` accepted, or None:
    an 8-bit pool needs one contiguous fp32 CPU ``[num_blocks, block_size, kv_heads]`` K and V
    scale pool per layer, a float32 one none; fixed scales, one positive finite pair per
    layer, only with an 8-bit pool."""
    layers = len(k_caches)
    if k_caches[0].dtype == torch.float32:
        if k_scales or v_scales or fixed is not None:
            return "scales or fixed scales given with float32 pools"
        return None
    if len(k_scales) != layers or len(v_scales) != layers:
        return f"an 8-bit pool needs one K and one V scale pool per layer ({layers})"
    want = tuple(k_caches[0].shape[:3])
    for t in (*k_scales, *v_scales):
        if tuple(t.shape) != want or t.dtype != torch.float32:
            return f"the scale pools are not all fp32 {want}"
        if not t.is_cpu or not t.is_contiguous():
            return "the scale pools are not contiguous CPU tensors"
    if fixed is not None:
        if len(fixed) != layers:
            return f"fixed scales for {len(fixed)} layers, not {layers}"
        if not all(0.0 < s < float("inf") for f in fixed for s in (f.k, f.v)):
            return "a fixed KV scale that is not positive and finite"
    return None


def _edges(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent._modules.items()
        if child is not None
    ]


def _bias_fits(linear: torch.nn.Linear) -> bool:
    return linear.bias is None or tuple(linear.bias.shape) == (linear.out_features,)


def _exactly(obj: object, cls: type) -> bool:
    """``type(obj) is cls``: a subclass may compute something else."""
    return type(obj) is cls
