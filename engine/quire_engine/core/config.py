"""Frozen, validated configuration for the engine's control side.

Every user-facing size is checked in ``__post_init__`` and rejected with a ``ValueError`` naming the
field and the limit, so a bad flag fails at start-up instead of deep inside a step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_BLOCK_SIZE = 256
DEFAULT_MASTER_PORT = 29500  # node 0's rendezvous under several nodes (torch's usual port)


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


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; `block_size=True` is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Shape of the paged KV pool.

    ``num_blocks`` is the GPU (or CPU-device) pool; ``num_cpu_blocks`` is the swap pool used by
    ``PreemptionMode.SWAP`` (0 disables swapping). ``sliding_window``: the window every layer of
    the model obeys (None when any layer attends to the whole context); blocks wholly before it
    are released while a sequence runs.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_cpu_blocks: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        block_size = _check_int("block_size", self.block_size)
        if not _is_power_of_two(block_size) or block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be a power of two in 1..{MAX_BLOCK_SIZE}; got {block_size}"
            )
        if _check_int("num_blocks", self.num_blocks) < 1:
            raise ValueError(f"num_blocks must be >= 1; got {self.num_blocks}")
        if _check_int("num_cpu_blocks", self.num_cpu_blocks) < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0; got {self.num_cpu_blocks}")
        if (
            self.sliding_window is not None
            and _check_int("sliding_window", self.sliding_window) < 1
        ):
            raise ValueError(f"sliding_window must be None or >= 1; got {self.sliding_window}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduler step and of one sequence."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if _check_int(name, getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        # Accept the string form ("swap") from flags and keyword arguments.
        object.__setattr__(self, "preemption_mode", PreemptionMode.parse(self.preemption_mode))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything ``LLM(...)`` and ``quire-engine serve`` accept, with their (vLLM-like) defaults.

    ``None`` means "derive it": ``max_model_len`` from the model, ``max_num_batched_tokens`` from
    ``max_model_len``, the pool size from ``num_blocks``, else ``kv_cache_memory``, else device
    memory. ``swap_space`` (GiB) sizes the CPU pool used only by ``preemption_mode="swap"``.
    ``chat_template`` (a Jinja template or the path of a file holding one) replaces the
    tokenizer's own; a model with neither refuses chat requests. ``tensor_parallel_size``: the
    number of ranks (processes, one device each) the model's layers are sharded over, on all
    nodes together; 1 runs the model in the engine process alone.

    Several nodes (``nnodes`` > 1, e.g. the pods of one LeaderWorkerSet group): each runs
    ``tensor_parallel_size // nnodes`` consecutive ranks; node ``node_rank`` 0 is the engine
    (rank 0, the scheduler) and listens for the other nodes at ``master_addr``:``master_port``,
    where they connect. With one node the ranks meet on an ephemeral loopback port instead.
    """

    model: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    chat_template: str | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    def __post_init__(self) -> None:
        object.__setattr__(self, "preemption_mode", PreemptionMode.parse(self.preemption_mode))
        if _check_int("tensor_parallel_size", self.tensor_parallel_size) < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        self._check_nodes()
        block_size = _check_int("block_size", self.block_size)
        if not _is_power_of_two(block_size) or block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be a power of two in 1..{MAX_BLOCK_SIZE}; got {block_size}"
            )
        for name in ("num_blocks", "kv_cache_memory", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and _check_int(name, value) < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if _check_int("max_num_seqs", self.max_num_seqs) < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB; got {self.swap_space}")
        _check_int("seed", self.seed)

    def _check_nodes(self) -> None:
        if _check_int("nnodes", self.nnodes) < 1:
            raise ValueError(f"nnodes must be >= 1; got {self.nnodes}")
        if not 0 <= _check_int("node_rank", self.node_rank) < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}; got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}, the ranks of all nodes) must "
                f"be a multiple of nnodes ({self.nnodes})"
            )
        if not 1 <= _check_int("master_port", self.master_port) <= 65535:
            raise ValueError(f"master_port must be in 1..65535; got {self.master_port}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(
                f"master_addr must be a host name or address; got {self.master_addr!r}"
            )

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks (processes, devices) on each node."""
        return self.tensor_parallel_size // self.nnodes
