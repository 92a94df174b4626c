"""LoRA adapters on the model side: the step's adapter slots, and the batched low-rank update
every targeted linear layer adds.

Ownership: ``LoRAModel`` owns the adapters' tensors of one model (of one tensor-parallel rank):
a host LRU of up to ``max_cpu_loras`` loaded adapters (``LoRAWeights``, read from their peft
directories by ``lora_files``), the ``max_loras`` slots a step reads (per targeted layer, A
stacked as [slots, max_rank, in] and B as [slots, out, max_rank], zero-padded to
``max_lora_rank``; on CUDA ``kernels/lora_triton`` runs the update as one Triton shrink and
expand per layer), and an instance ``forward`` on each targeted ``nn.Linear`` (over whatever
forward it had: the native few-row kernel's included). The runner calls ``prepare`` before a
step's forward with each sequence's adapter id, and ``finish`` after it.

The update: for a linear y = x W^T (+ b), an adapter adds s * (x A^T) B^T with A [r, in],
B [out, r] and s = lora_alpha / r (``use_rslora``: / sqrt(r)), peft's definition; s is folded
into B when the adapter is loaded. One step mixes adapters and the base model: the tokens of each
adapter in the step are gathered (``index_select``), multiplied through their slot's A and B at
the adapter's own rank, and added back in place (``index_add_``); base-model tokens take no
extra work. What is served: adapters on the linear layers of the decoder blocks (attention and
MLP projections; MoE experts are fused 3-D weights, not linear layers, and are refused), without
DoRA, bias training, modules_to_save, per-layer patterns or fan_in_fan_out. Each is refused by
name, before any request runs with it.

Tensor parallelism: every rank has its own ``LoRAModel`` over its shard of the model, holding
its shard of each adapter (``lora_files``). A column-parallel layer's update is local; a
row-parallel layer's (``RowParallelLinear``) is added to the rank's partial product before the
layer's all-reduce (``partial`` is wrapped, not ``forward``): the sum over ranks of
(x_i A_i^T) B^T is the whole update, with no further communication. Rank 0's model records
every adapter it adds or removes (``record``); the runner sends those ``AdapterChange``s in the
next step's plan, and the other ranks ``follow`` them (each reading its own shard from the
adapter's directory) before running it. Slots are then assigned by the same plans on every
rank; a rank's slot numbers never leave it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from quire_engine.core.config import LoRAConfig
from quire_engine.core.lora import BASE, AdapterChange, LoRARequest
from quire_engine.kernels.lora_triton import lora_expand, lora_shrink
from quire_engine.kernels.triton_runtime import triton_usable
from quire_engine.model.lora_files import LoRAWeights, load_adapter, targets
from quire_engine.model.sharding import RowParallelLinear


@dataclass(frozen=True, slots=True)
class _Group:
    """The tokens of one adapter in a step: its slot, its rank and the rows of the step."""

    slot: int
    rank: int
    rows: torch.Tensor  # int64 [n]: row indices into the step's packed tokens


class LoRAModel:
    """See the module docstring. Not thread-safe: the engine thread alone calls it."""

    def __init__(
        self, model: nn.Module, config: LoRAConfig, device: torch.device, *, record: bool = False
    ) -> None:
        """``record``: keep the ``AdapterChange``s other tensor-parallel ranks must repeat
        (rank 0 of a group; ``take_changes`` hands them over)."""
        self.config = config
        self.targets = targets(model)
        self.dtype = next(model.parameters()).dtype
        slots, rank = config.max_loras, config.max_lora_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, target in self.targets.items():
            out_features, in_features = target.local_shape
            self.a[name] = torch.zeros(slots, rank, in_features, dtype=self.dtype, device=device)
            self.b[name] = torch.zeros(slots, out_features, rank, dtype=self.dtype, device=device)
            module = target.module
            if isinstance(module, RowParallelLinear):  # before the all-reduce
                module.partial = self._wrap(name, module.partial)  # type: ignore[method-assign,assignment]
            else:
                module.forward = self._wrap(name, module.forward)  # type: ignore[method-assign,assignment]
        self._changes: list[AdapterChange] | None = [] if record else None
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
        if weights is None and known is None:
            weights = self.insert(self.load(request))
        elif weights is None:  # dropped by the host LRU: its files again, its slot still good
            weights = self._keep(self.load(request))
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
        slot = self.slot_of.pop(lora_id, None)  # reloaded: the slot takes the new weights
        if slot is not None:
            self.slot_rank[slot] = 0
        if self._changes is not None:
            self._changes.append(AdapterChange(lora_id, weights.request))
        return self._keep(weights)

    def _keep(self, weights: LoRAWeights) -> LoRAWeights:
        """Put an added adapter's weights in the host LRU, dropping the oldest beyond it."""
        lora_id = weights.request.lora_int_id
        self.loaded[lora_id] = weights
        self.loaded.move_to_end(lora_id)
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
        known = self.requests.pop(lora_id, None) is not None
        if known and self._changes is not None:
            self._changes.append(AdapterChange(lora_id, None))
        return known

    def take_changes(self) -> tuple[AdapterChange, ...]:
        """The adapters added and removed since the last call, in order (rank 0 of a
        tensor-parallel group: for the next step's plan); () when not recording."""
        if not self._changes:
            return ()
        changes, self._changes = tuple(self._changes), []
        return changes

    def follow(self, changes: Sequence[AdapterChange]) -> None:
        """Repeat rank 0's adapter changes on this rank (another tensor-parallel rank, before
        running the plan that carries them): each adapter added is read again, this rank's
        shard of it."""
        for change in changes:
            if change.request is None:
                self.remove(change.lora_id)
            else:
                self.insert(self.load(change.request))

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
