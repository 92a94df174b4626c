"""LoRA adapters on the control side: what a request names, and the rule that keeps a step within
the adapter slots. Pure Python (no tensors: ``model/lora`` owns the weights).

``LoRARequest`` is vLLM's (``lora_name``, ``lora_int_id``, ``lora_path``): ``lora_int_id`` >= 1
identifies the adapter everywhere inside the engine (0 is the base model, ``BASE``); a request's
sequences carry it (``Sequence.lora_id``), the prefix cache keys blocks by it and the adapter's
directory (an adapter changes every layer's K/V, so two adapters never share a block, nor an
adapter and the base, nor an id reused after an unload), and the
scheduler admits a sequence only while the distinct adapters of the running sequences stay within
``max_loras`` (``AdapterSlots``), so every step fits the model side's slots. Under tensor
parallelism the adapters rank 0 adds and removes reach the other ranks as ``AdapterChange``s in
the next step's plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BASE = 0  # the lora id of the base model


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One adapter, as vLLM names it: ``lora_path`` is a peft adapter directory
    (``adapter_config.json`` and ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer; got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 is the base model); got {self.lora_int_id}"
            )
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")


def hash_extra(cache_salt: str | None, lora_id: int, lora_path: str = "") -> str | None:
    """The extra key of a sequence's first block hash (the chain carries it to every block): the
    tenant's salt and the adapter, by id and directory (an id may name another adapter once the
    first is unloaded). The base model without a salt keeps ``None``, so its hashes are those of
    an engine without LoRA."""
    if lora_id == BASE:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora_id}\x00{lora_path}"


@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """The scheduler's rule: a step holds at most ``max_loras`` distinct adapters (the base model
    takes no slot). ``max_loras`` 0: LoRA is off and every sequence is the base model's."""

    max_loras: int

    def admits(self, running: Iterable[int], lora_id: int) -> bool:
        """Whether a sequence of ``lora_id`` may join sequences of ``running`` adapter ids."""
        if lora_id == BASE:
            return True
        active = {i for i in running if i != BASE}
        return lora_id in active or len(active) < self.max_loras


@dataclass(frozen=True, slots=True)
class AdapterChange:
    """One change to the adapters rank 0 serves, which every other tensor-parallel rank repeats
    before its next step: ``request`` (re)loaded (its id's slot takes the new weights), or, when
    None, adapter ``lora_id`` forgotten."""

    lora_id: int
    request: LoRARequest | None
