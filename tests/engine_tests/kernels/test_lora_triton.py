"""The Triton LoRA kernels (``kernels/lora_triton``) against their torch references.

- Under Triton's interpreter (CPU, in a child pytest, as ``test_kernels.py`` explains): shrink
  and expand over a step mixing base-model tokens (slot -1) and three adapters, ranks padded,
  feature counts that are not multiples of the tiles, fp32 and fp16 activations; base tokens'
  outputs are untouched bit for bit.
- Compiled for an H100/H200 (sm_90) without a GPU, as the attention kernels are.
- ``gpu``-marked: the same comparisons on a device.
"""

from __future__ import annotations

import pytest
import torch

from quire_engine.kernels.lora_triton import (
    BLOCK_K,
    BLOCK_N,
    _lora_expand_kernel,
    _lora_shrink_kernel,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
)
from tests.engine_tests.kernels.test_kernels import (
    _TRITON_TYPES,
    LIVE,
    _compile_for_hopper,
    run_interpreter_suite,
)

gpu = pytest.mark.gpu
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture
def interpret() -> None:
    if not LIVE:
        pytest.skip("run by test_lora_triton_interpreter_suite in a child process")


@pytest.mark.slow  # a child pytest under the interpreter
def test_lora_triton_interpreter_suite() -> None:
    run_interpreter_suite(__file__)


def _step(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """x [11, 72], A [4, 16, 72], B [4, 40, 16] (slot 2 of rank 5: zero-padded), slots with
    base tokens (-1) among three adapters, and y [11, 40]."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 72, generator=gen).to(dtype)
    a = torch.randn(4, 16, 72, generator=gen) * 0.1
    b = torch.randn(4, 40, 16, generator=gen) * 0.1
    a[2, 5:], b[2, :, 5:] = 0, 0
    slots = torch.tensor([-1, 0, 2, 2, -1, 3, 0, -1, 3, 3, 2], dtype=torch.int32)
    y = torch.randn(11, 40, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, a.to(dtype), b.to(dtype), slots, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_interpreted_shrink_and_expand_match_the_references(
    interpret: None, dtype: torch.dtype
) -> None:
    x, a, b, slots, y = _step(dtype)
    t = lora_shrink(x, a, slots)
    t_ref = lora_shrink_reference(x, a, slots)
    torch.testing.assert_close(t, t_ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    base = slots < 0
    assert torch.equal(t[base], torch.zeros_like(t[base]))
    out = lora_expand(y.clone(), t_ref, b, slots)
    ref = lora_expand_reference(y.clone(), t_ref, b, slots)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOLERANCE[dtype], atol=1e-3)
    assert torch.equal(out[base], y[base])  # base-model tokens untouched, bit for bit
    assert not torch.equal(out[~base], y[~base])


def test_the_references_refuse_shapes_that_do_not_fit() -> None:
    x, a, b, slots, y = _step(torch.float32)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink_reference(x, a, slots[:3])
    with pytest.raises(ValueError, match="stacked"):
        lora_expand_reference(y, x, b[0], slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_lora_kernels_compile_for_hopper(dtype: torch.dtype) -> None:
    import triton

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    elem = "*" + _TRITON_TYPES[dtype]
    shrink = {"x_ptr": elem, "a_ptr": elem, "slots_ptr": "*i32", "out_ptr": "*fp32"}
    _compile_for_hopper(_lora_shrink_kernel, shrink, {"BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K})
    expand = {"t_ptr": "*fp32", "b_ptr": elem, "slots_ptr": "*i32", "y_ptr": elem}
    _compile_for_hopper(_lora_expand_kernel, expand, {"BLOCK_N": BLOCK_N, "BLOCK_R": 16})


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_shrink_and_expand_on_the_device(dtype: torch.dtype) -> None:
    x, a, b, slots, y = _step(dtype, "cuda")
    t = lora_shrink(x, a, slots)
    torch.testing.assert_close(t, lora_shrink_reference(x, a, slots), rtol=1e-2, atol=1e-2)
    out = lora_expand(y.clone(), t, b, slots)
    ref = lora_expand_reference(y.clone(), t, b, slots)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
