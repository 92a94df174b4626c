"""``spec.lora``: the LoRA adapters an InferenceService serves beside its base model.

Frozen views made by spec/parsing.py. With ``spec.lora`` every replica runs with LoRA on and
runtime loading allowed (``--enable-lora --allow-runtime-lora-updating``, the slot limits below);
the adapters themselves are not engine flags: the operator loads them into each ready replica
through ``/v1/load_lora_adapter`` (reconcile/adapters.py), so adding or removing one restarts
nothing. ``__post_init__`` re-checks what the CRD's rules check and raises ``ValueError`` naming
the field.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from urllib.parse import quote

# What a client puts in ``model``: the CRD's pattern for an adapter's name.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# The engine's default slot and rank limits (quire_engine.core.config.LoRAConfig).
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


class AdapterKind(enum.Enum):
    # A Hub repository: downloaded into the model cache by a Job of its own, or, without a
    # cache, by each replica as it loads it.
    HF = "hf"
    PVC = "pvc"  # a directory on a PersistentVolumeClaim, mounted read-only
    FILE = "file"  # a directory already inside the image


@dataclass(frozen=True)
class Adapter:
    """One adapter: served under ``name`` from a peft directory (``adapter_config.json`` and
    its safetensors) that ``kind``/``location``/``sub_path``/``revision`` say where to find."""

    name: str
    kind: AdapterKind
    # hf: "org/name"; pvc: the claim's name; file: the absolute path.
    location: str
    sub_path: str = ""  # pvc: the directory inside the claim ("" for its root)
    revision: str | None = None  # hf: a branch, tag or commit (None: main)
    # The rank the spec declares (None: not declared): checked against max_lora_rank when the
    # spec is read, before any replica reads the files (which check the real rank again).
    rank: int | None = None

    def __post_init__(self) -> None:
        if not ADAPTER_NAME.match(self.name):
            raise ValueError(
                f"lora.adapters[].name must be 1-128 of A-Z a-z 0-9 . _ - starting with a letter "
                f"or digit: {self.name!r}"
            )
        if self.revision is not None and self.kind is not AdapterKind.HF:
            raise ValueError(f"lora.adapters[{self.name}].revision applies only to hf:// adapters")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"lora.adapters[{self.name}].rank must be >= 1: {self.rank}")

    @property
    def uri(self) -> str:
        """The adapter's source as the spec writes it."""
        if self.kind is AdapterKind.HF:
            return f"hf://{self.location}"
        if self.kind is AdapterKind.PVC:
            return f"pvc://{self.location}/{self.sub_path}".rstrip("/")
        return f"file://{self.location}"

    @property
    def cache_subdir(self) -> str:
        """hf: its directory in the model cache, relative to the volume's root: one per
        repository and revision, as the model's (deployment.model_dir)."""
        assert self.kind is AdapterKind.HF, self.kind
        return f"{self.location}/@{quote(self.revision or 'main', safe='')}"


@dataclass(frozen=True)
class LoRASpec:
    """``spec.lora``: the engine's adapter limits (vLLM's flags) and the adapters."""

    max_loras: int = DEFAULT_MAX_LORAS  # --max-loras: distinct adapters in one step
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK  # --max-lora-rank
    max_cpu_loras: int | None = None  # --max-cpu-loras: the host LRU (None: max_loras)
    adapters: tuple[Adapter, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("lora.maxLoras and lora.maxLoraRank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.maxCpuLoras ({self.max_cpu_loras}) must be >= lora.maxLoras "
                f"({self.max_loras})"
            )
        for adapter in self.adapters:
            if adapter.rank is not None and adapter.rank > self.max_lora_rank:
                raise ValueError(
                    f"lora.adapters[{adapter.name}].rank {adapter.rank} is above "
                    f"lora.maxLoraRank {self.max_lora_rank}"
                )
        names = [adapter.name for adapter in self.adapters]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"lora.adapters: each name once; repeated: {', '.join(repeated)}")

    def claims(self) -> tuple[str, ...]:
        """The PersistentVolumeClaims pvc:// adapters are on, each once, sorted."""
        return tuple(sorted({a.location for a in self.adapters if a.kind is AdapterKind.PVC}))
