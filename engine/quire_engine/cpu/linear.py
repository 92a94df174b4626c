"""Small-batch ``nn.Linear`` on CPU through the native few-row kernel.

A decode step of a few sequences multiplies a handful of rows by every weight of the model, so
its matmuls are bound by streaming the weights from memory. A BLAS sgemm first packs panels of
the weight into scratch, which at a few rows adds about as much traffic again;
``csrc/skinny_linear.c`` reads each weight once, in place. Calls of at most ``MAX_ROWS`` rows go
to it (above, the BLAS is as fast or faster: ``quire-engine bench linear``; figures in
docs/benchmarks.md).

Rows above ``MAX_ROWS`` (prefill chunks, mixed steps) go to a GEMM: oneDNN's fp32 linear
(``gemm``) where this torch has it, ``torch.nn.functional.linear`` (MKL's sgemm in the official
wheels) otherwise. MKL picks its AVX-512 kernels only on Intel CPUs; elsewhere it runs its AVX2
ones, while oneDNN dispatches on the CPU's features. Other dtypes, autograd, and modules whose
weight the kernels cannot read (not fp32, not contiguous, not on CPU) go to ``F.linear``
unchanged.

Contract: inside the few-row range every output element is summed in an order that depends only
on the input width, so in a step of at most ``MAX_ROWS`` rows a sequence's matmul results are
the same bits whatever other sequences share the step; results differ from ``F.linear``'s by
rounding. ``_Routed`` checks what the unchecked ``SkinnyLinear.launch`` relies on (dtype,
device, width, a readable weight, contiguous input) at every call.

Ownership: ``install`` sets an instance ``forward`` on each routed ``nn.Linear`` of the one
model it is given (the class, its hooks and other models are untouched); the module keeps its
weight and bias, read at every call. CPU only: on CUDA cuBLAS and the Triton path are used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from quire_engine.cpu.native import SkinnyLinear

# The most rows the native kernel takes; above it the BLAS is as fast or faster (see above).
MAX_ROWS = 16

# y = x @ w.T + b for fp32 CPU tensors, x [..., K], w [N, K], b [N] or None.
Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # The op inductor's CPU backend emits for a linear; "none": no fused activation.
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@functools.cache
def gemm() -> Gemm:
    """The GEMM for matmuls above ``MAX_ROWS`` rows: oneDNN's linear if this torch has it and
    it agrees with ``F.linear`` on a probe (a private op: a torch without it, or with other
    semantics, falls back rather than computing something else), else ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return F.linear
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((2, 5, 24), (40, 24), (40,)))
    try:
        with torch.inference_mode():
            got = _onednn(x, w, b)
    except (AttributeError, RuntimeError):
        return F.linear
    want = F.linear(x, w, b)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        return F.linear
    return _onednn


def readable(*tensors: torch.Tensor | None) -> bool:
    """Whether the native kernels can read these tensors (None: an absent bias): fp32, on
    CPU, contiguous."""
    return all(
        t is None or (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous()) for t in tensors
    )


class _Routed:
    """The forward of one routed ``nn.Linear``: few rows to the kernel, the rest to torch.

    It runs on every matmul of a decode step, so it calls the kernel unchecked
    (``SkinnyLinear.launch``) after checking here what that needs: the weight is re-checked at
    every call (cheap attribute reads: ``module.to`` or ``.data =`` may have changed it since
    ``install``), the input's width must match it, the input is made contiguous and the output
    is allocated here, already in its final shape."""

    __slots__ = ("gemm", "kernel", "module")

    def __init__(self, module: torch.nn.Linear, kernel: SkinnyLinear, gemm: Gemm) -> None:
        self.module = module
        self.kernel = kernel
        self.gemm = gemm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        if (
            not rows
            or x.dtype != torch.float32
            or not x.is_cpu
            or weight.shape[1] != width
            or not readable(weight, bias)
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        ):
            return F.linear(x, weight, bias)
        if not x.is_contiguous():
            x = x.contiguous()
        if rows > MAX_ROWS:
            return self.gemm(x, weight, bias)
        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
        self.kernel.launch(x, rows, weight, bias, out, torch.get_num_threads())
        return out


def install(model: torch.nn.Module, kernel: SkinnyLinear, big: Gemm | None = None) -> int:
    """Route ``model``'s fp32 CPU ``nn.Linear`` modules with contiguous weights through
    ``kernel`` for calls of at most ``MAX_ROWS`` rows and through ``big`` (default ``gemm()``)
    above; returns how many were routed.

    Only modules whose forward is ``nn.Linear``'s own: a subclass with its own forward (LoRA,
    scaled or quantized linears) or a module whose forward something else already replaced
    (e.g. accelerate's offload hooks) computes something else, and is left alone."""
    big = gemm() if big is None else big
    routed = 0
    for module in model.modules():
        if (
            isinstance(module, torch.nn.Linear)
            and type(module).forward is torch.nn.Linear.forward
            and "forward" not in vars(module)
            and readable(module.weight, module.bias)
        ):
            module.forward = _Routed(module, kernel, big)  # type: ignore[method-assign,assignment]
            routed += 1
    return routed


def routed(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` that ``install`` routed."""
    return isinstance(module, torch.nn.Linear) and isinstance(module.forward, _Routed)
