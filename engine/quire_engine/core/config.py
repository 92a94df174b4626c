"""The engine's configuration: one frozen tree, each field declared once (``knobs``).

``EngineConfig`` is what ``LLM(...)`` and ``quire-engine serve`` accept: ``model``
(``ModelConfig``), ``cache`` (``CacheConfig``), ``scheduler`` (``SchedulerConfig``),
``parallel`` (``ParallelConfig``), ``lora`` (``LoRAConfig``) and ``seed``. Every field carries
its flag, environment variable, default, bounds and help; ``__post_init__`` checks the
declared bounds (``knobs.check``, a ``ValueError`` naming the field and the limit, so a bad flag
fails at start-up instead of deep inside a step) and then the cross-field rules, written out
below.

The parts take their sub-configs as they are: ``Scheduler(config.scheduler, config.cache)``.
``None`` means "derive it at start-up": ``max_model_len`` from the model,
``max_num_batched_tokens`` from ``max_model_len``, the pool size (``num_blocks``) from
``kv_cache_memory``, else device memory. ``plan_cache`` resolves them once, with
``dataclasses.replace`` on the sub-config; ``num_cpu_blocks`` and ``sliding_window`` are derived
only (no flag). ``EngineConfig.from_flat`` maps the flat names (``block_size=8``) into the tree.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quire_engine.core import knobs
from quire_engine.core.knobs import knob, section

MAX_BLOCK_SIZE = 256
DEFAULT_MASTER_PORT = 29500  # node 0's rendezvous under several nodes (torch's usual port)
DTYPES = ("auto", "float32", "bfloat16", "float16")


class PreemptionMode(enum.Enum):
    """What happens to a running sequence when the pool cannot grow it."""

    RECOMPUTE = "recompute"  # free its blocks; re-prefill later (the prefix cache often hits)
    SWAP = "swap"  # copy its blocks to the CPU pool and back

    @classmethod
    def parse(cls, value: str | PreemptionMode) -> PreemptionMode:
        if isinstance(value, PreemptionMode):
            return value
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"preemption_mode must be one of {choices}; got {value!r}") from None


class KVCacheDtype(enum.Enum):
    """What one K or V element of the paged pool is stored as (vLLM's ``--kv-cache-dtype``
    names). ``AUTO`` keeps the model's dtype; the 8-bit formats store one byte per element plus
    a float32 scale per token and KV head (``kernels.kv_quant``), about a quarter of float32's
    bytes at head_dim 64 and above. ``FP8`` is vLLM's alias of ``FP8_E4M3``; configs hold the
    canonical member (``canonical``)."""

    AUTO = "auto"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"

    @property
    def canonical(self) -> KVCacheDtype:
        return KVCacheDtype.FP8_E4M3 if self is KVCacheDtype.FP8 else self

    @property
    def quantized(self) -> bool:
        return self is not KVCacheDtype.AUTO


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to load, where, and in which dtype."""

    model: str | None = knob(
        "tiny",
        "checkpoint directory, GGUF file (or a directory holding one), or 'tiny' for the "
        "embedded model",
    )
    device: str = knob("auto", "auto, cpu, cuda or cuda:N")
    dtype: str = knob(
        "auto", "weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU)", choices=DTYPES
    )
    chat_template: str | None = knob(
        None, "chat template (Jinja text, or a file holding it) replacing the tokenizer's own"
    )
    tokenizer: str | None = knob(
        None, "tokenizer directory replacing the model's own (a GGUF file's, a checkpoint's)"
    )

    def __post_init__(self) -> None:
        knobs.check(self)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Shape of the paged KV pool.

    ``num_blocks`` is the GPU (or CPU-device) pool; ``num_cpu_blocks`` is the swap pool used by
    ``PreemptionMode.SWAP`` (0 disables swapping), sized from ``swap_space`` (GiB).
    ``sliding_window``: the window every layer of the model obeys (None when any layer attends
    to the whole context); blocks wholly before it are released while a sequence runs.
    ``num_host_blocks`` is the host tier under the prefix cache (``core/host_tier``), sized from
    ``kv_offloading_size`` (GiB, all tensor-parallel ranks together, as vLLM's flag); it needs
    prefix caching. The swap pool and the tier are separate host allocations, each with its own
    budget, so neither can starve the other: a swapped sequence never loses its blocks to cached
    prefixes, and preemption never drops the tier's prefixes.
    """

    num_blocks: int | None = knob(
        None,
        "KV pool size in blocks (overrides --kv-cache-memory and --gpu-memory-utilization)",
        min=1,
        metavar="N",
    )
    block_size: int = knob(16, "tokens per KV block", power_of_two=True, max=MAX_BLOCK_SIZE)
    enable_prefix_caching: bool = knob(True, "share KV blocks of identical prompt prefixes")
    num_cpu_blocks: int = knob(0, "CPU swap pool in blocks (from --swap-space)", min=0, flag=False)
    sliding_window: int | None = knob(
        None, "the model's sliding attention window (from the model)", min=1, flag=False
    )
    kv_cache_memory: int | None = knob(
        None,
        "KV pool size (bytes, or 4G / 4GiB); overrides --gpu-memory-utilization",
        min=1,
        parse=knobs.parse_bytes,
        unit="bytes",
        metavar="SIZE",
    )
    gpu_memory_utilization: float = knob(
        0.9, "share of GPU memory for weights, activations and the KV pool", above=0, max=1
    )
    swap_space: float = knob(
        4.0, "CPU swap pool for --preemption-mode swap (GiB)", min=0, unit="GiB"
    )
    kv_cache_dtype: KVCacheDtype = knob(
        KVCacheDtype.AUTO,
        "KV pool element type: auto (the model's dtype), or 8 bits with a scale per token and KV "
        "head: fp8 (= fp8_e4m3), fp8_e5m2, int8",
    )
    kv_offloading_size: float = knob(
        0.0,
        "host-memory tier under the prefix cache (GiB, all tensor-parallel ranks together): "
        "prefix blocks the KV pool evicts are kept there and copied back instead of recomputed; "
        "0 disables",
        min=0,
        unit="GiB",
    )
    num_host_blocks: int = knob(
        0, "host tier in blocks (from --kv-offloading-size)", min=0, flag=False
    )

    def __post_init__(self) -> None:
        knobs.check(self)
        # One spelling per format downstream (vLLM's "fp8" is e4m3).
        object.__setattr__(self, "kv_cache_dtype", self.kv_cache_dtype.canonical)
        if (self.kv_offloading_size or self.num_host_blocks) and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size needs enable_prefix_caching: the host tier keeps prefix "
                "blocks by their hash"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduler step and of one sequence."""

    max_num_seqs: int = knob(256, "sequences running at once", min=1)
    max_num_batched_tokens: int | None = knob(
        None, "tokens per step (default: max(2048, min(max_model_len, 8192)))", min=1
    )
    max_model_len: int | None = knob(None, "context length (default: the model's)", min=1)
    preemption_mode: PreemptionMode = knob(
        PreemptionMode.RECOMPUTE, "what preemption does to a victim's KV blocks"
    )

    def __post_init__(self) -> None:
        knobs.check(self)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Adapters served beside the base model (vLLM's flags): ``max_loras`` slots in a step (the
    distinct adapters of the running sequences), ranks up to ``max_lora_rank``, and an LRU of
    ``max_cpu_loras`` adapters kept loaded in host memory (default: ``max_loras``)."""

    enable_lora: bool = knob(False, "serve LoRA adapters (peft format) beside the base model")
    max_loras: int = knob(1, "distinct adapters in one step (slots of the model)", min=1)
    max_lora_rank: int = knob(16, "the largest adapter rank accepted", min=1)
    max_cpu_loras: int | None = knob(
        None, "adapters kept loaded in host memory, LRU (default: --max-loras)", min=1
    )

    def __post_init__(self) -> None:
        knobs.check(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def step_slots(self) -> int:
        """Adapter slots of a step: ``max_loras`` with LoRA on, 0 off."""
        return self.max_loras if self.enable_lora else 0


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` ranks (processes, one device each) the
    model's layers are sharded over, on all nodes together; 1 runs the model in the engine
    process alone.

    Several nodes (``nnodes`` > 1, e.g. the pods of one LeaderWorkerSet group): each runs
    ``tensor_parallel_size // nnodes`` consecutive ranks; node ``node_rank`` 0 is the engine
    (rank 0, the scheduler) and listens for the other nodes at ``master_addr``:``master_port``,
    where they connect. With one node the ranks meet on an ephemeral loopback port instead.

    ``threads``: the node's CPU threads, split over its ranks on CPU (``core.threads`` resolves
    the default from the cgroup quota; the engine applies it at start).
    """

    tensor_parallel_size: int = knob(
        1,
        "shard the model over this many devices, one worker process each (cuda:N..N+size-1)",
        min=1,
    )
    nnodes: int = knob(
        1, "nodes (pods) the --tensor-parallel-size ranks are spread over, equally", min=1
    )
    node_rank: int = knob(
        0, "this node's index; node 0 serves HTTP and listens for the others on --host", min=0
    )
    master_addr: str = knob("127.0.0.1", "node 0's address, where nodes >= 1 connect")
    master_port: int = knob(
        DEFAULT_MASTER_PORT, "node 0's rendezvous port (under --nnodes > 1)", min=1, max=65535
    )
    threads: int | None = knob(
        None,
        "CPU threads of torch and the native kernels, all ranks of this node together (default: "
        "OMP_NUM_THREADS when set, else the cgroup CPU quota rounded down, at least 1, at most "
        "the CPUs this process may run on; without a quota, those CPUs)",
        min=1,
        metavar="N",
    )

    def __post_init__(self) -> None:
        knobs.check(self)
        if not self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}; got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}, the ranks of all nodes) must "
                f"be a multiple of nnodes ({self.nnodes})"
            )
        if not self.master_addr:
            raise ValueError(
                f"master_addr must be a host name or address; got {self.master_addr!r}"
            )

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks (processes, devices) on each node."""
        return self.tensor_parallel_size // self.nnodes


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything ``LLM(...)`` and ``quire-engine serve`` accept, with their (vLLM-like)
    defaults, as a tree (see the module docstring). ``chat_template`` replaces the tokenizer's
    own; a model with neither refuses chat requests."""

    model: ModelConfig = section(ModelConfig)
    cache: CacheConfig = section(CacheConfig)
    scheduler: SchedulerConfig = section(SchedulerConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    lora: LoRAConfig = section(LoRAConfig)
    seed: int = knob(0, "seed of unseeded sampling")

    def __post_init__(self) -> None:
        knobs.check(self)

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any] | None = None, **kwargs: Any) -> EngineConfig:
        """The tree from flat names, the serve flags in snake_case (``block_size=8``,
        ``tensor_parallel_size=2``); ``ValueError`` naming an unknown one."""
        return knobs.build(cls, {**(flat or {}), **kwargs})
