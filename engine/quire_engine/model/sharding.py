"""Megatron-style tensor parallelism over transformers' own modules: which module is sharded how,
the sharded modules, and the refusals.

The engine runs transformers' modeling code (see ``attention``); under tensor parallelism each
rank keeps that code and swaps some of its modules for sharded ones holding only this rank's
slice of the weights (read by name from a ``WeightSource``):

* column-parallel (a plain ``nn.Linear`` with fewer output rows, no communication): ``q_proj``
  (this rank's query heads), ``k_proj`` / ``v_proj`` (its KV heads), fused ``qkv_proj`` (the
  three parts), ``gate_proj`` / ``up_proj`` and fused ``gate_up_proj`` (its intermediate rows);
* row-parallel (``RowParallelLinear``: the matching input columns, then an all-reduce):
  ``o_proj`` and ``down_proj``;
* vocabulary-parallel (``VocabParallelEmbedding``, ``VocabParallelHead``): the embedding's rows
  of this rank's vocabulary range (the others' are zeros, summed by an all-reduce), and the LM
  head's logits of that range, gathered so every rank holds the full row for sampling;
* OLMo 2's q/k RMSNorm over whole projections (``ShardedRMSNorm``): the sum of squares is
  all-reduced;
* mixture-of-experts blocks (``moe``): every expert column-/row-parallel over its intermediate
  dimension, the router replicated, one all-reduce of the block's output.

Every sharded linear layer carries its ``LinearShard`` (attribute ``tp_shard``): the whole
layer's shape and this rank's slices of it, what a LoRA adapter's A or B is cut by (``lora_files``).

Attention layers reshape their projections with ``-1`` heads, so they run on this rank's heads
unchanged (Phi-3 reads the query width from its config: it gets a copy with local head counts).
KV heads are split across ranks, or replicated when there are more ranks than KV heads (each rank
keeps the one its query heads read, as vLLM does). Norms, rotary tables and everything else are
replicated. Refused, with the architecture and the reason (``check``): head counts the ranks do
not divide, expert intermediate sizes the ranks do not divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from quire_engine.model import moe, weights
from quire_engine.model.collectives import Collectives, Shard
from quire_engine.model.weights import WeightSource


class HeadSplit(NamedTuple):
    """This rank's query heads and KV heads (head indices, not rows)."""

    q: Shard
    kv: Shard


def head_split(heads: int, kv_heads: int, comm: Collectives) -> HeadSplit:
    per_q = heads // comm.world
    q = Shard(comm.rank * per_q, (comm.rank + 1) * per_q, heads)
    if kv_heads >= comm.world:
        per_kv = kv_heads // comm.world
        return HeadSplit(q, Shard(comm.rank * per_kv, (comm.rank + 1) * per_kv, kv_heads))
    # Replicated: rank r's query heads all read KV head r * kv / world.
    idx = comm.rank * kv_heads // comm.world
    return HeadSplit(q, Shard(idx, idx + 1, kv_heads))


def _head_counts(cfg: Any) -> tuple[int, int, int]:
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    return heads, kv, head_dim


def check(cfg: Any, world: int) -> None:
    """``ValueError`` naming the architecture and why it cannot be split over ``world`` ranks."""
    arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    heads, kv, _ = _head_counts(cfg)
    why = None
    if heads % world:
        why = f"its {heads} attention heads do not split evenly over {world} ranks"
    elif kv % world and world % kv:
        why = f"its {kv} KV heads neither split over nor replicate evenly onto {world} ranks"
    elif getattr(cfg, "model_type", "") == "olmo2" and kv < world:
        why = (
            f"its k_norm spans all {kv} KV heads, which {world} ranks would replicate "
            "(use at most as many ranks as KV heads)"
        )
    else:
        why = moe.refusal(cfg, world)
    if why is not None:
        raise ValueError(f"{arch} cannot run with tensor_parallel_size={world}: {why}")


def local_kv_heads(cfg: Any, world: int) -> int:
    _, kv, _ = _head_counts(cfg)
    return max(kv // world, 1)


@dataclass(frozen=True, slots=True)
class LinearShard:
    """How one linear layer of the whole model is split on this rank: ``dim`` 0 column-parallel
    (``parts``: its output rows here, concatenated), 1 row-parallel (``parts``: its input
    columns here); ``out_features`` x ``in_features``: the whole layer's weight."""

    dim: int
    parts: tuple[Shard, ...]
    out_features: int
    in_features: int


class ColumnParallelLinear(nn.Linear):
    """A plain ``nn.Linear`` of this rank's output rows (no communication), tagged."""

    tp_shard: LinearShard


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: this rank's input columns of ``W``. The
    local product is ``partial`` (what a LoRA update adds to, before the all-reduce)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in_local]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm
        self.tp_shard: LinearShard | None = None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``x W^T``: [..., T, in_local] -> [..., T, out]."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``vocab`` of the embedding; other ids embed to zeros here and are summed in by the
    rank owning them. ``scale``: Gemma's scaled embedding (applied after the sum, as there)."""

    def __init__(
        self, weight: torch.Tensor, vocab: Shard, scale: torch.Tensor | None, comm: Collectives
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab_local, hidden]
        self.vocab = vocab
        self.embed_scale: torch.Tensor | None
        self.register_buffer("embed_scale", scale, persistent=False)
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, stop, _ = self.vocab
        outside = (ids < start) | (ids >= stop)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        out = self.comm.all_reduce(out)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.weight.dtype)
        return out


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary range, gathered into full rows on every rank."""

    def __init__(self, weight: torch.Tensor, vocab: Shard, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab_local, hidden]
        self.vocab = vocab
        self.per_rank = -(-vocab.total // comm.world)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        pad = self.per_rank - self.vocab.size  # the last rank's share may be short
        if pad:
            logits = F.pad(logits, (0, pad))
        return self.comm.all_gather_last(logits, self.vocab.total)


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a whole sharded projection (OLMo 2's q/k norms): mean of squares over
    every rank's share, computed in float32 as the original does."""

    def __init__(self, weight: torch.Tensor, eps: float, full: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.full = full
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        sq = self.comm.all_reduce(x.pow(2).sum(-1, keepdim=True))
        x = x * torch.rsqrt(sq / self.full + self.eps)
        return (self.weight * x).to(dtype)


def _rows(shard: Shard, width: int) -> Shard:
    """Head indices -> rows of a projection with ``width`` rows per head."""
    return Shard(shard.start * width, shard.stop * width, shard.total * width)


def _offset(shard: Shard, by: int) -> Shard:
    return Shard(shard.start + by, shard.stop + by, shard.total)


class _Plan:
    """What each module name becomes on this rank."""

    def __init__(self, model: Any, comm: Collectives, source: WeightSource) -> None:
        cfg: Any = model.config
        heads, kv, head_dim = _head_counts(cfg)
        split = head_split(heads, kv, comm)
        self.cfg, self.comm, self.source = cfg, comm, source
        self.split = split
        self.q_rows = _rows(split.q, head_dim)
        self.kv_rows = _rows(split.kv, head_dim)
        self.q_width = heads * head_dim
        self.kv_width = kv * head_dim
        self.vocab = comm.split(int(cfg.vocab_size))
        embed = model.get_input_embeddings()
        self.embed_name = next(n for n, m in model.named_modules() if m is embed)
        # A tied LM head is the embedding's matrix (the checkpoint stores it once).
        self.head_name = self.embed_name if getattr(cfg, "tie_word_embeddings", False) else None

    def column(
        self, name: str, linear: nn.Linear, parts: tuple[Shard, ...]
    ) -> ColumnParallelLinear:
        weight = self.source.read(f"{name}.weight", 0, parts)
        out = ColumnParallelLinear(
            weight.shape[1], weight.shape[0], linear.bias is not None, device="meta"
        )
        out.weight = nn.Parameter(weight, requires_grad=False)
        if linear.bias is not None:
            out.bias = nn.Parameter(self.source.read(f"{name}.bias", 0, parts), requires_grad=False)
        out.tp_shard = LinearShard(0, parts, linear.out_features, linear.in_features)
        return out

    def row(self, name: str, linear: nn.Linear, cols: Shard) -> RowParallelLinear:
        weight = self.source.read(f"{name}.weight", 1, (cols,))
        bias = self.source.read(f"{name}.bias") if linear.bias is not None else None
        out = RowParallelLinear(weight, bias, self.comm)
        out.tp_shard = LinearShard(1, (cols,), linear.out_features, linear.in_features)
        return out

    def replace(self, name: str, attr: str, child: nn.Module) -> nn.Module | None:
        q, kv = self.q_rows, self.kv_rows
        if moe.is_moe_block(child):
            return moe.shard_block(name, child, self.cfg.model_type, self.comm, self.source)
        if isinstance(child, nn.Linear):
            if attr == "q_proj":
                return self.column(name, child, (q,))
            if attr in ("k_proj", "v_proj"):
                return self.column(name, child, (kv,))
            if attr == "qkv_proj":  # [q; k; v] rows
                k_at, v_at = self.q_width, self.q_width + self.kv_width
                return self.column(name, child, (q, _offset(kv, k_at), _offset(kv, v_at)))
            if attr == "o_proj":
                return self.row(name, child, q)
            if attr in ("gate_proj", "up_proj"):
                return self.column(name, child, (self.comm.split(child.out_features),))
            if attr == "gate_up_proj":  # [gate; up] rows
                inter = self.comm.split(child.out_features // 2)
                return self.column(name, child, (inter, _offset(inter, inter.total)))
            if attr == "down_proj":
                return self.row(name, child, self.comm.split(child.in_features))
            if attr == "lm_head":
                weight = self.source.read(f"{self.head_name or name}.weight", 0, (self.vocab,))
                return VocabParallelHead(weight, self.vocab, self.comm)
            raise ValueError(f"no tensor-parallel rule for the linear layer {name}")
        if isinstance(child, nn.Embedding) and attr == "embed_tokens":
            weight = self.source.read(f"{name}.weight", 0, (self.vocab,))
            scale = getattr(child, "embed_scale", None)
            return VocabParallelEmbedding(weight, self.vocab, scale, self.comm)
        if attr in ("q_norm", "k_norm"):
            width = getattr(child, "weight", torch.empty(0)).shape[0]
            rows = q if attr == "q_norm" else kv
            if width == rows.total:  # a norm over the whole projection, not one head
                weight = self.source.read(f"{name}.weight", 0, (rows,))
                eps = float(getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6)))
                return ShardedRMSNorm(weight, eps, rows.total, self.comm)
        return None


def shard_model(model: Any, comm: Collectives, source: WeightSource) -> None:
    """Replace ``model``'s modules by this rank's shards in place (see the module docstring);
    every parameter left on the meta device afterwards is read whole (replicated)."""
    check(model.config, comm.world)
    plan = _Plan(model, comm, source)
    for prefix, module in list(model.named_modules()):
        for attr, child in list(module.named_children()):
            name = f"{prefix}.{attr}" if prefix else attr
            new = plan.replace(name, attr, child)
            if new is not None:
                setattr(module, attr, new)
        if hasattr(module, "num_key_value_heads") and hasattr(module, "o_proj"):
            module.num_key_value_heads = plan.split.kv.size
        if hasattr(module, "qkv_proj") and hasattr(module, "config"):
            # Phi-3 reads the query width from config.num_attention_heads at forward time.
            module.config = _LocalHeads(module.config, plan.split.q.size)
    if plan.head_name is not None:  # one parameter for both, as transformers ties them
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    weights.fill(model, source)


class _LocalHeads:
    """A model config seen by one attention module: its own query head count, everything else
    (the attention implementation included, which the engine switches) read live."""

    def __init__(self, config: Any, num_attention_heads: int) -> None:
        self._config = config
        self.num_attention_heads = num_attention_heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
