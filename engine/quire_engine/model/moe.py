"""Mixture-of-experts blocks under tensor parallelism: which configs split, how each rank reads its
share of every expert, and the block that all-reduces it.

As vLLM's fused MoE layer does under plain tensor parallelism (no expert parallelism), every rank
keeps every expert and the router, but only its share of each expert's intermediate dimension:
the gate and up projections are column-parallel (this rank's intermediate rows), the down
projection row-parallel (the matching input columns). A token routed to an expert therefore goes
through that expert on every rank, each rank adds up its partial outputs over the token's top-k
experts, and one all-reduce of the block's output (``ReducedMoE``) sums them: not one per expert.
The router's weight is replicated, so every rank routes every token identically, and the routing
details of each architecture (softmax then top-k, Qwen3-MoE's optional ``norm_topk_prob``) stay
in transformers' own router, untouched.

transformers holds the experts of a block as two fused parameters, ``experts.gate_up_proj``
[experts, 2 * intermediate, hidden] (gate rows, then up rows) and ``experts.down_proj``
[experts, hidden, intermediate]; each rank's copy has ``intermediate / world`` in place of
``intermediate``, and transformers' experts code runs on it unchanged. Checkpoints store one
tensor per expert and projection (``CheckpointLayout``: Mixtral's ``block_sparse_moe.experts.E.w1``
(gate), ``w3`` (up), ``w2`` (down); Qwen3-MoE's ``mlp.experts.E.gate_proj`` / ``up_proj`` /
``down_proj``), or the fused tensors themselves (a model's own state dict); either way a rank reads
only its rows and columns. Qwen3-MoE's dense layers (``mlp_only_layers``) are plain MLPs and
shard as such (``sharding``). Neither supported architecture has a shared expert.

The ranks must divide the experts' intermediate size (``refusal``): otherwise they are refused.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from quire_engine.model.collectives import Collectives, Shard
from quire_engine.model.weights import WeightSource


class CheckpointLayout(NamedTuple):
    """How a checkpoint names a MoE block's tensors: the block's own name in place of the model's
    ``mlp`` and each expert's gate, up and down projections (``<block>.experts.<e>.<gate>``)."""

    block: str
    gate: str
    up: str
    down: str


# By config.model_type.
LAYOUTS: dict[str, CheckpointLayout] = {
    "mixtral": CheckpointLayout("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": CheckpointLayout("mlp", "gate_proj", "up_proj", "down_proj"),
}


def num_experts(cfg: Any) -> int:
    """How many routed experts a MoE layer of ``cfg`` has (0: a dense model)."""
    return int(getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0)


def expert_intermediate_size(cfg: Any) -> int:
    """The width of one expert's gate/up output (Qwen3-MoE's ``moe_intermediate_size``, Mixtral's
    ``intermediate_size``)."""
    return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def refusal(cfg: Any, world: int) -> str | None:
    """Why the MoE layers of ``cfg`` cannot be split over ``world`` ranks, or None when they can
    (or when ``cfg`` has none)."""
    if not num_experts(cfg):
        return None
    model_type = getattr(cfg, "model_type", "")
    if model_type not in LAYOUTS:
        return (
            f"Quire has no tensor-parallel rule for the experts of {model_type!r} models "
            "(serve it with tensor_parallel_size=1)"
        )
    inter = expert_intermediate_size(cfg)
    if inter % world:
        return (
            f"its experts' intermediate size {inter} does not split evenly over {world} ranks "
            "(each rank holds an equal share of every expert)"
        )
    return None


def is_moe_block(module: nn.Module) -> bool:
    """A transformers sparse MoE block: a router ``gate`` and fused 3-D ``experts`` weights."""
    experts = getattr(module, "experts", None)
    fused = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return hasattr(module, "gate") and all(
        isinstance(p, nn.Parameter) and p.dim() == 3 for p in fused
    )


class ReducedMoE(nn.Module):
    """A transformers MoE block (``block``) holding this rank's share of every expert: its output
    [batch, seq, hidden], this rank's partial sum over the routed experts, is all-reduced once."""

    def __init__(self, block: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.block = block
        self.comm = comm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.block(hidden_states))


def shard_block(
    name: str, block: nn.Module, model_type: str, comm: Collectives, source: WeightSource
) -> ReducedMoE:
    """Fill ``block`` (the model's module ``name``, parameters on the meta device) with the router
    and this rank's share of every expert, read from ``source``; return it wrapped for the
    all-reduce."""
    layout = LAYOUTS[model_type]
    # The checkpoint names the block as the model does (a state dict, Qwen3-MoE) or its own way.
    prefix = name
    if not source.has(f"{name}.gate.weight"):
        prefix = f"{name.rpartition('.')[0]}.{layout.block}"
    router: Any = block.gate
    for pname, _ in list(router.named_parameters()):
        router.register_parameter(pname, _frozen(source.read(f"{prefix}.gate.{pname}")))

    experts: Any = block.experts
    count, two_inter, _ = experts.gate_up_proj.shape
    inter = comm.split(two_inter // 2)  # this rank's intermediate rows of every expert
    fused = f"{prefix}.experts.gate_up_proj"
    if source.has(fused):  # [gate; up] rows: this rank's of each half
        gate_rows = Shard(inter.start, inter.stop, two_inter)
        up_rows = Shard(inter.start + inter.total, inter.stop + inter.total, two_inter)
        gate_up = source.read(fused, 1, (gate_rows, up_rows))  # [experts, 2 * inter_local, hidden]
        down = source.read(f"{prefix}.experts.down_proj", 2, (inter,))  # [E, hidden, inter_local]
    else:
        gate_ups, downs = [], []
        for e in range(count):
            at = f"{prefix}.experts.{e}"
            gate = source.read(f"{at}.{layout.gate}.weight", 0, (inter,))  # [inter_local, hidden]
            up = source.read(f"{at}.{layout.up}.weight", 0, (inter,))
            gate_ups.append(torch.cat([gate, up]))
            downs.append(source.read(f"{at}.{layout.down}.weight", 1, (inter,)))
        gate_up, down = torch.stack(gate_ups), torch.stack(downs)
    experts.gate_up_proj = _frozen(gate_up)
    experts.down_proj = _frozen(down)
    experts.intermediate_dim = inter.size
    return ReducedMoE(block, comm)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
