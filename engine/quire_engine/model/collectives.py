"""One rank's view of its tensor-parallel group: who it is and the collectives the sharded layers
call (``sharding``).

Owns a c10d process group built directly on a store (``torch.distributed.ProcessGroupGloo`` on
CPU, ``ProcessGroupNCCL`` on CUDA) rather than torch's global default group, so several engines
can live in one process (tests, benchmarks) and closing one leaves the others alone. Who creates
the group and the store is ``parallel/``; this module only wraps it.

Every collective is blocking and must be called by every rank in the same order: the ranks run
the same step plan through the same modules, so they do.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class Shard(NamedTuple):
    """Rows ``[start, stop)`` of a dimension of ``total`` split over the group (the last rank's
    share may be shorter, or empty, when ``total`` does not divide)."""

    start: int
    stop: int
    total: int

    @property
    def size(self) -> int:
        return self.stop - self.start


# A c10d backend used directly (torch's ProcessGroup wraps one): ProcessGroupGloo or
# ProcessGroupNCCL. Any: torch's stubs do not declare their collectives.
C10dGroup = Any


class Collectives:
    """Rank ``rank`` of ``world`` ranks, over ``group``. Also counts the seconds spent in
    collectives (``comm_seconds``), for the benchmark's all-reduce share."""

    def __init__(self, group: C10dGroup | None, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.comm_seconds = 0.0
        self.calls = 0
        self._closed = False

    def close(self) -> None:
        """Drop the process group now (its gloo threads or NCCL communicators go with it), not
        whenever the last module holding this object is collected: a group left to interpreter
        exit can hang it. A collective after this raises."""
        self.group, self._closed = None, True

    def _live(self) -> C10dGroup | None:
        if self._closed:
            raise RuntimeError("the tensor-parallel group is closed (the engine was closed)")
        return self.group

    def split(self, total: int) -> Shard:
        """This rank's contiguous share of ``total`` rows: ``ceil(total / world)`` each."""
        per = -(-total // self.world)
        start = min(self.rank * per, total)
        return Shard(start, min(start + per, total), total)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place: the element-wise sum (or ``op``, a ``ReduceOp``) over the ranks."""
        group = self._live()
        if group is None:
            return tensor
        started = time.perf_counter()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        group.allreduce([tensor], opts).wait()
        self.comm_seconds += time.perf_counter() - started
        self.calls += 1
        return tensor

    def all_gather_last(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` [..., per] along the last dimension and keep the
        first ``width`` columns (the shares are padded to ``per`` columns each)."""
        group = self._live()
        if group is None:
            return tensor[..., :width]
        started = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        group.allgather([parts], [tensor.contiguous()]).wait()
        self.comm_seconds += time.perf_counter() - started
        self.calls += 1
        return torch.cat(parts, dim=-1)[..., :width]

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        self.all_reduce(t, dist.ReduceOp.MIN)
        return int(t.item())


def new_group(
    store: dist.Store, rank: int, world: int, device: torch.device, timeout: float
) -> C10dGroup:
    """The c10d backend for ``device``: NCCL on CUDA, gloo on CPU."""
    wait = timedelta(seconds=timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = wait
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, wait)
