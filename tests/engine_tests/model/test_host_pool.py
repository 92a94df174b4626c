"""``HostPool``: the host tier's copies move a block's every byte, 8-bit data with its float32
scales, from the device pool's block to the host block and back into another device block; a
block read by an offload may be overwritten by a load in the same step (the runner's order)."""

from __future__ import annotations

import pytest
import torch

from quire_engine.model.host_pool import HostPool
from quire_engine.model.runner import zeroed

# The CUDA case (copy stream, pinned staging, deferred completion) runs in benchmarks/gpu.sh.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _pools(device: torch.device, num_blocks: int = 6) -> list[torch.Tensor]:
    """Two layers' int8 K and V [blocks, block_size 4, kv_heads 2, head_dim 8] and their scales
    [blocks, 4, 2], filled with distinct values."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(-127, 128, (num_blocks, 4, 2, 8), generator=g, dtype=torch.int8)]
    data += [torch.randint(-127, 128, (num_blocks, 4, 2, 8), generator=g, dtype=torch.int8)]
    scales = [torch.rand((num_blocks, 4, 2), generator=g) for _ in range(2)]
    return [t.to(device) for t in (*data, *scales)]


@pytest.mark.parametrize("device_name", DEVICES)
def test_offload_then_load_moves_every_byte_and_scale(device_name: str) -> None:
    device = torch.device(device_name)
    pools = _pools(device)
    before = [t.clone() for t in pools]
    host = HostPool(pools, 4, device, zeroed)
    assert [t.dtype for t in host.tensors] == [t.dtype for t in pools]
    assert host.nbytes == sum(t[:4].numel() * t.element_size() for t in pools)
    host.offload(pools, [(1, 3), (4, 0)])
    # The same step overwrites device block 1 (a load's destination): the offload read it first.
    host.load(pools, [(3, 5)])  # completes the pending offload first
    for t in pools:
        t[1] = 0
    host.finish()
    host.load(pools, [(0, 2), (3, 1)])
    for t, b in zip(pools, before, strict=True):
        assert torch.equal(t[5].cpu(), b[1].cpu()) and torch.equal(t[1].cpu(), b[1].cpu())
        assert torch.equal(t[2].cpu(), b[4].cpu())
        assert torch.equal(t[0].cpu(), b[0].cpu())  # untouched
    for h, b in zip(host.tensors, before, strict=True):
        assert torch.equal(h[3], b[1].cpu()) and torch.equal(h[0], b[4].cpu())
