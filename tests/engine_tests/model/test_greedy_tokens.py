"""The sampler's greedy pick (numpy's argmax on CPU) is torch.argmax: same rows, same first
maximum on exact ties, strided views included."""

from __future__ import annotations

import pytest
import torch

from quire_engine.model.sampler import greedy_tokens


@pytest.mark.parametrize("shape", [(1, 5), (7, 320), (64, 4096)])
def test_greedy_tokens_equal_torch_argmax(shape: tuple[int, int]) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x[:, 3] = x.max(dim=-1).values  # an exact tie in every row: the first maximum wins
    for view in (x, x[:, ::2], x.double()):
        got = greedy_tokens(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
    with torch.inference_mode():  # the runner's logits are inference tensors
        assert torch.equal(greedy_tokens(x.clone()), x.argmax(dim=-1))
