"""A peft LoRA adapter directory read into the tensors this rank serves.

Ownership: ``load_adapter`` owns nothing: it reads ``adapter_config.json`` and
``adapter_model.safetensors``, refuses what the engine cannot serve (by name), and returns a
``LoRAWeights`` that its caller (``lora.LoRAModel``) keeps. ``Target`` describes one linear layer
an adapter may target as this rank holds it.

Every check (the rank, each module's A [r, in] and B [out, r] against the layer) uses the whole
layer's shape, so an adapter is refused with the same message at any tensor-parallel size. Under
tensor parallelism each rank then keeps only its shard of the adapter, as vLLM does: for a
column-parallel layer (its output rows split) A whole and B's rows of this rank; for a
row-parallel layer (its input columns split) A's columns of this rank and B whole, so that each
rank's ``(x_local A_local^T) B^T`` is its share of the update, summed by the layer's all-reduce
with the base output. Replicated layers (an MoE router) keep the whole adapter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from quire_engine.core.lora import LoRARequest
from quire_engine.model.sharding import LinearShard, RowParallelLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# adapter_config.json settings an adapter may carry only at these values (what peft writes for a
# plain LoRA): anything else changes the computation beyond A and B.
PLAIN: dict[str, tuple[Any, Any]] = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
}


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter in host memory: per targeted module (the model's module name), A [r, in] and
    the scaled B [out, r], in the model's dtype; this rank's shard of each (``in``, ``out``: the
    layer's local widths)."""

    request: LoRARequest
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Target:
    """A linear layer an adapter may target, as this rank holds it: ``module`` (an
    ``nn.Linear``, or a ``RowParallelLinear`` whose ``partial`` the update joins), and its
    ``shard`` (None: the whole layer is here)."""

    module: nn.Linear | RowParallelLinear
    shard: LinearShard | None

    @property
    def full_shape(self) -> tuple[int, int]:
        """[out, in] of the whole layer, on every rank."""
        if self.shard is not None:
            return self.shard.out_features, self.shard.in_features
        out_features, in_features = self.module.weight.shape
        return int(out_features), int(in_features)

    @property
    def local_shape(self) -> tuple[int, int]:
        """[out, in] of this rank's weight: the slots' widths."""
        out_features, in_features = self.module.weight.shape
        return int(out_features), int(in_features)

    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A [r, in_local] and B [out_local, r] of the whole A [r, in], B [out, r]."""
        shard = self.shard
        if shard is None:
            return a, b
        if shard.dim == 0:  # column-parallel: this rank's output rows of B
            return a, torch.cat([b[p.start : p.stop] for p in shard.parts])
        return torch.cat([a[:, p.start : p.stop] for p in shard.parts], dim=1), b


def targets(model: nn.Module) -> dict[str, Target]:
    """The linear layers an adapter may target: those inside the decoder blocks, sharded or
    not."""
    return {
        name: Target(module, getattr(module, "tp_shard", None))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | RowParallelLinear) and ".layers." in f".{name}"
    }


def load_adapter(
    request: LoRARequest, targets: dict[str, Target], max_rank: int, dtype: torch.dtype
) -> LoRAWeights:
    """Read ``request``'s peft directory; ``ValueError`` naming what the engine cannot serve
    (a missing file, a rank above ``max_rank``, a setting beyond plain LoRA, a module the model
    lacks or whose shape differs: an adapter of another base model)."""
    where = Path(request.lora_path)
    config_path, weights_path = where / ADAPTER_CONFIG, where / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(
            f"LoRA adapter {request.lora_name!r}: {where} must hold {ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS} (a peft adapter directory)"
        )
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: bad {config_path}: {err}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {request.lora_name!r}: peft_type {config['peft_type']}")
    for key, allowed in PLAIN.items():
        if config.get(key) not in allowed:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: {key}={config.get(key)!r} is not served "
                "(plain LoRA on linear layers only)"
            )
    if not 1 <= rank <= max_rank:
        raise ValueError(
            f"LoRA adapter {request.lora_name!r} has rank {rank}; max_lora_rank is {max_rank}"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {request.lora_name!r}: unexpected tensor {key!r}")
        pairs.setdefault(stem, {})[part[0]] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pair in sorted(pairs.items()):
        target = targets.get(name)
        if target is None:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} targets {name!r}, not a linear layer of "
                "this model's decoder blocks (another base model, or an embedding or lm_head)"
            )
        a, b = pair.get("A"), pair.get("B")  # the whole A [r, in], B [out, r]
        out_features, in_features = target.full_shape
        if (
            a is None
            or b is None
            or a.shape != (rank, in_features)
            or b.shape != (out_features, rank)
        ):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: {name}'s A/B do not fit the model's "
                f"[{out_features}, {in_features}] weight at rank {rank} (another base model?)"
            )
        a, b = target.local(a, b)
        modules[name] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not modules:
        raise ValueError(f"LoRA adapter {request.lora_name!r} holds no LoRA weights")
    return LoRAWeights(request, rank, modules)
