"""LoRA adapters on the model side: loading peft adapters, the step's adapter slots, and the
batched low-rank update every targeted linear layer adds.

Ownership: ``LoRAModel`` owns the adapters' tensors of one model: a host LRU of up to
``max_cpu_loras`` loaded adapters (``LoRAWeights``, read from their peft directories), the
``max_loras`` slots a step reads (per targeted layer, A stacked as [slots, max_rank, in] and B as
[slots, out, max_rank], zero-padded to ``max_lora_rank``; on CUDA ``kernels/lora_triton`` runs
the update as one Triton shrink and expand per layer), and an instance ``forward`` on each
targeted ``nn.Linear`` (over whatever forward it had: the native few-row kernel's included). The
runner calls ``prepare`` before a step's forward with each sequence's adapter id, and ``finish``
after it.

The update: for a linear y = x W^T (+ b), an adapter adds s * (x A^T) B^T with A [r, in],
B [out, r] and s = lora_alpha / r (``use_rslora``: / sqrt(r)), peft's definition; s is folded
into B when the adapter is loaded. One step mixes adapters and the base model: the tokens of each
adapter in the step are gathered (``index_select``), multiplied through their slot's A and B at
the adapter's own rank, and added back in place (``index_add_``); base-model tokens take no
extra work. What is served: adapters on the linear layers of the decoder blocks (attention and
MLP projections; MoE experts are fused 3-D weights, not linear layers, and are refused), without
DoRA, bias training, modules_to_save, per-layer patterns or fan_in_fan_out. Each is refused by
name, before any request runs with it.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from quire_engine.core.config import LoRAConfig
from quire_engine.core.lora import BASE, LoRARequest
from quire_engine.kernels.lora_triton import lora_expand, lora_shrink
from quire_engine.kernels.triton_runtime import triton_usable

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
    the scaled B [out, r], in the model's dtype."""

    request: LoRARequest
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _targets(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers an adapter may target: those inside the decoder blocks."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in f".{name}"
    }


def load_adapter(
    request: LoRARequest, targets: dict[str, nn.Linear], max_rank: int, dtype: torch.dtype
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
        module = targets.get(name)
        if module is None:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} targets {name!r}, not a linear layer of "
                "this model's decoder blocks (another base model, or an embedding or lm_head)"
            )
        a, b = pair.get("A"), pair.get("B")
        out_features, in_features = module.weight.shape
        if (
            a is None
            or b is None
            or a.shape != (rank, in_features)
            or b.shape
            != (
                out_features,
                rank,
            )
        ):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r}: {name}'s A/B do not fit the model's "
                f"[{out_features}, {in_features}] weight at rank {rank} (another base model?)"
            )
        modules[name] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not modules:
        raise ValueError(f"LoRA adapter {request.lora_name!r} holds no LoRA weights")
    return LoRAWeights(request, rank, modules)


@dataclass(frozen=True, slots=True)
class _Group:
    """The tokens of one adapter in a step: its slot, its rank and the rows of the step."""

    slot: int
    rank: int
    rows: torch.Tensor  # int64 [n]: row indices into the step's packed tokens


class LoRAModel:
    """See the module docstring. Not thread-safe: the engine thread alone calls it."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.config = config
        self.targets = _targets(model)
        self.dtype = next(model.parameters()).dtype
        slots, rank = config.max_loras, config.max_lora_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, module in self.targets.items():
            out_features, in_features = module.weight.shape
            self.a[name] = torch.zeros(slots, rank, in_features, dtype=self.dtype, device=device)
            self.b[name] = torch.zeros(slots, out_features, rank, dtype=self.dtype, device=device)
            module.forward = self._wrap(name, module.forward)  # type: ignore[method-assign,assignment]
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by lora_int_id
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # host LRU, oldest first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU order
        self.slot_rank = [0] * slots
        self._groups: list[_Group] | None = None
        # CUDA: the Triton shrink/expand pair over each token's slot (int32 [T], -1: base).
        self.use_triton = triton_usable(device)
        self._token_slots: torch.Tensor | None = None
        self.device = device
        # Whether ``add`` loads an adapter it has never seen (the offline API). A server sets it
        # off: adapters arrive through ``insert`` (read off the step loop) and a request may
        # name only those, never one unloaded a moment ago.
        self.autoload = True

    # ---- adapters -------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAWeights:
        """Load ``request`` (or refresh it in the host LRU); ``ValueError`` if it cannot be
        served, or if its id is taken by another adapter."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is {known.lora_name!r} "
                f"({known.lora_path}); {request.lora_name!r} needs another id"
            )
        if known is None and not self.autoload:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded")
        weights = self.loaded.get(request.lora_int_id)
        if weights is None:
            weights = self.insert(self.load(request))
        self.loaded.move_to_end(request.lora_int_id)
        return weights

    def load(self, request: LoRARequest) -> LoRAWeights:
        """Read and check an adapter without touching this model's state: safe on any thread
        (the server loads off the engine's step loop, then ``insert``s on it)."""
        return load_adapter(request, self.targets, self.config.max_lora_rank, self.dtype)

    def insert(self, weights: LoRAWeights) -> LoRAWeights:
        """Add loaded weights to the host LRU (a newer copy of an adapter replaces its slot)."""
        lora_id = weights.request.lora_int_id
        known = self.requests.get(lora_id)
        if known is not None and known != weights.request:
            raise ValueError(
                f"lora_int_id {lora_id} is {known.lora_name!r}; "
                f"{weights.request.lora_name!r} needs another id"
            )
        self.requests[lora_id] = weights.request
        self.loaded[lora_id] = weights
        self.loaded.move_to_end(lora_id)
        slot = self.slot_of.pop(lora_id, None)  # reloaded: the slot takes the new weights
        if slot is not None:
            self.slot_rank[slot] = 0
        while len(self.loaded) > self.config.cpu_loras:
            self.loaded.popitem(last=False)
        return weights

    @property
    def names(self) -> dict[int, str]:
        """lora_int_id -> lora_name of every adapter added."""
        return {i: r.lora_name for i, r in self.requests.items()}

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its host copy and its slot); False if it was not added."""
        self.loaded.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slot_rank[slot] = 0
        return self.requests.pop(lora_id, None) is not None

    def _weights(self, lora_id: int) -> LoRAWeights:
        request = self.requests.get(lora_id)
        if request is None:
            raise ValueError(f"LoRA adapter id {lora_id} was never added")
        return self.add(request)  # reloaded from its directory if the LRU dropped it

    def _slot(self, lora_id: int, keep: set[int]) -> int:
        """The slot holding ``lora_id``, filling one (free, else the least recently used one
        not in ``keep``) if it holds none."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slot_of if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"more than {self.config.max_loras} adapters in one step")
            slot = self.slot_of.pop(victim)
        weights = self._weights(lora_id)
        for name in self.targets:
            pair = weights.modules.get(name)
            self.a[name][slot].zero_()
            self.b[name][slot].zero_()
            if pair is not None:
                a, b = pair
                self.a[name][slot, : weights.rank].copy_(a)
                self.b[name][slot, :, : weights.rank].copy_(b)
        self.slot_rank[slot] = weights.rank
        self.slot_of[lora_id] = slot
        return slot

    def fill_slot(self, lora_id: int) -> int:
        """Copy an added adapter into a step slot now (else the first step that needs it does);
        returns the slot."""
        return self._slot(lora_id, set())

    # ---- one step -------------------------------------------------------------------------
    def prepare(self, lora_ids: np.ndarray | None, counts: np.ndarray) -> None:
        """Set the coming forward's groups: ``lora_ids`` int64 [S] per sequence (None: all
        base), ``counts`` int64 [S] new tokens per sequence, packed in that order."""
        self._groups, self._token_slots = None, None
        if lora_ids is None:
            return
        token_ids = np.repeat(lora_ids, counts)  # [T]
        wanted = sorted({int(i) for i in lora_ids} - {BASE})
        keep = set(wanted)
        groups = []
        token_slots = np.full(token_ids.shape, -1, dtype=np.int32)
        for lora_id in wanted:
            slot = self._slot(lora_id, keep)
            rows = np.flatnonzero(token_ids == lora_id)
            token_slots[rows] = slot
            groups.append(
                _Group(slot, self.slot_rank[slot], torch.from_numpy(rows).to(self.device))
            )
        self._groups = groups
        if self.use_triton:
            self._token_slots = torch.from_numpy(token_slots).to(self.device, non_blocking=True)

    def finish(self) -> None:
        self._groups, self._token_slots = None, None

    def _wrap(
        self, name: str, forward: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        a_slots, b_slots = self.a[name], self.b[name]

        def lora_forward(x: torch.Tensor) -> torch.Tensor:
            y = forward(x)  # [..., T, out]
            groups = self._groups
            if not groups:
                return y
            slots = self._token_slots
            if slots is not None:  # CUDA: every adapter of the step in one shrink and expand
                flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
                lora_expand(flat_y, lora_shrink(flat_x, a_slots, slots), b_slots, slots)
                return y
            dim = x.dim() - 2  # the token axis of [1, T, in] (or [T, in])
            for g in groups:
                xs = x.index_select(dim, g.rows)  # [..., n, in]
                a = a_slots[g.slot, : g.rank]  # [r, in]
                b = b_slots[g.slot, :, : g.rank]  # [out, r]
                y.index_add_(dim, g.rows, (xs @ a.T) @ b.T)
            return y

        return lora_forward
