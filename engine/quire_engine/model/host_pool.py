"""The host tier's tensors and its copies to and from the device pool (``--kv-offloading-size``).

``HostPool`` owns one host tensor per block-major tensor of the device pool, in
``ModelRunner.device_pools``' order (every layer's K and V data, then, for an 8-bit pool, their
float32 scales): a host block ``h`` is index ``h`` of each, so a block moves with its scales and
the tier holds 8-bit blocks as they are. ``core/host_tier`` decides which host block holds which
prefix; this module only copies (``ModelRunner`` is its only user and calls it from
``_move_blocks``, in the order ``SchedulerOutput`` documents).

* ``offload`` (device -> host) reads the evicted device blocks before anything of the step
  writes them. On CPU it is a plain gather and scatter. On CUDA the gather runs on the current
  stream (so it reads before the step's later writes on that stream), a copy stream moves the
  gathered blocks to pinned staging memory while the forward runs, and the scatter into the host
  tensors is deferred to the next ``finish`` (the start of a later step's moves): no step waits
  for an offload.
* ``load`` (host -> device) first completes pending offloads (a load may read what an earlier
  step, or rarely this one, offloaded: then it waits for that copy), gathers the host blocks
  into pinned staging and copies them asynchronously on the current stream, ahead of the
  forward that reads them.

The host tensors themselves are plain pageable memory mapped lazily (``runner.zeroed``): a large
tier costs nothing at start-up and resident memory grows with the blocks it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quire_engine.kernels.kv_cache_ops import swap_blocks


def _pairs(moves: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [s for s, _ in moves], [d for _, d in moves]


@dataclass(frozen=True, slots=True)
class _InFlight:
    """One step's offload on CUDA: the staging copies and the host blocks they go to."""

    done: torch.cuda.Event
    staged: list[torch.Tensor]  # pinned [n, *block shape] per host tensor
    dst: torch.Tensor  # int64 [n] host block ids (CPU)


class HostPool:
    """``num_blocks`` host blocks shaped like the device pool's (see the module docstring)."""

    def __init__(
        self,
        device_pools: Sequence[torch.Tensor],
        num_blocks: int,
        device: torch.device,
        zeroed: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
    ) -> None:
        """``zeroed``: the runner's allocator of zero-filled tensors (lazy pages on CPU)."""
        self.num_blocks = num_blocks
        self.device = device
        cpu = torch.device("cpu")
        # [num_blocks, *block shape] per device tensor (data: [block_size, kv_heads, head_dim];
        # scales: [block_size, kv_heads]).
        self.tensors = [zeroed((num_blocks, *t.shape[1:]), t.dtype, cpu) for t in device_pools]
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._in_flight: list[_InFlight] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def offload(
        self, device_pools: Sequence[torch.Tensor], moves: Sequence[tuple[int, int]]
    ) -> None:
        """Copy device block ``src`` to host block ``dst`` for each move (see the docstring)."""
        if not moves:
            return
        if not self._cuda:
            swap_blocks(list(device_pools), self.tensors, list(moves))
            return
        assert self._stream is not None
        src, dst = _pairs(moves)
        index = torch.tensor(src, dtype=torch.long, device=self.device)
        # Gathered on the current stream: ordered before the step's writes into these blocks.
        gathered = [pool.index_select(0, index) for pool in device_pools]
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in gathered]
            for host, g in zip(staged, gathered, strict=True):
                host.copy_(g, non_blocking=True)
            done.record()
        for g in gathered:  # freed by the caching allocator only once the copy stream is done
            g.record_stream(self._stream)
        self._in_flight.append(_InFlight(done, staged, torch.tensor(dst, dtype=torch.long)))

    def finish(self) -> None:
        """Complete the pending offloads into the host tensors (CUDA; nothing to do on CPU).
        Called at the start of each step's moves, when the last step's copies are long done."""
        for flight in self._in_flight:
            flight.done.synchronize()
            for host, staged in zip(self.tensors, flight.staged, strict=True):
                host[flight.dst] = staged
        self._in_flight.clear()

    def load(self, device_pools: Sequence[torch.Tensor], moves: Sequence[tuple[int, int]]) -> None:
        """Copy host block ``src`` to device block ``dst`` for each move, before the forward."""
        if not moves:
            return
        self.finish()
        if not self._cuda:
            swap_blocks(self.tensors, list(device_pools), list(moves))
            return
        src, dst = _pairs(moves)
        index = torch.tensor(src, dtype=torch.long)
        target = torch.tensor(dst, dtype=torch.long, device=self.device)
        for host, pool in zip(self.tensors, device_pools, strict=True):
            staged = torch.empty((len(src), *host.shape[1:]), dtype=host.dtype, pin_memory=True)
            staged.copy_(host[index])  # indexing, as swap_blocks does: defined for 8-bit dtypes
            # Pinned source: asynchronous on the current stream, ahead of the forward's reads.
            pool[target] = staged.to(self.device, non_blocking=True)
