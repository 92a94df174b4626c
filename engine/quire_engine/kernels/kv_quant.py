"""8-bit KV cache elements: what a quantized pool stores, and the torch reference of writing
(quantizing) and reading (dequantizing) it, by torch dtype (the model layer maps
``--kv-cache-dtype`` to one). Every other implementation (the Triton write and attention
kernels, the native CPU kernels) computes the same numbers; this module owns the rule.

A quantized layer holds, per K and per V, the 8-bit data ``[num_blocks, block_size, kv_heads,
head_dim]`` (``int8``, ``float8_e4m3fn`` or ``float8_e5m2``) and its scales
``[num_blocks, block_size, kv_heads]`` float32: one per token and KV head, so a block's scales
are part of the block and move with it (swap, copy-on-write, prefix sharing) as rows of the
same block index. Element ``x`` of a token's head row is stored as ``q = cast(x / s)`` and read
back as ``float(q) * s``.

The scale of a row is never an unchecked 1.0: it is either
- dynamic (the default): ``s = amax(|row|) / QMAX`` computed in the write path, so every row
  uses the format's whole range and no calibration exists to go stale (an all-zero row gets
  ``s = 1``: it reads back as zeros whatever ``s`` is); or
- fixed (fp8 only): the checkpoint's per-tensor ``k_scale`` / ``v_scale`` (llm-compressor's
  calibrated scales), written into every row's scale slot so the readers stay uniform; values
  past the format's range saturate at ``±QMAX * s``.

Rounding: int8 rounds half to even (``torch.round``, C's ``nearbyintf``), fp8 casts round to
nearest even after clamping to ``±QMAX`` (e5m2 would otherwise overflow to inf, e4m3fn to NaN).
Scales are float32 whatever the model dtype: 4 bytes per (token, KV head) beside ``head_dim``
bytes of data, so a token costs ``(head_dim + 4) / (4 * head_dim)`` of float32's bytes (0.27 at
head_dim 64, 0.26 at 128).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_DTYPE = torch.float32
# The largest magnitude each format stores (int8 keeps -128 out, so the range is symmetric).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
QUANTIZED_DTYPES = tuple(QMAX)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


class FixedScales(NamedTuple):
    """One layer's per-tensor scales from the checkpoint (``k_scale``, ``v_scale``)."""

    k: float
    v: float


class LayerKV(NamedTuple):
    """One layer's paged cache as every reader and writer takes it: the data pools
    ``[num_blocks, block_size, kv_heads, head_dim]`` and, for an 8-bit pool, the scales
    ``[num_blocks, block_size, kv_heads]`` float32 (None otherwise) and the checkpoint's fixed
    scales if it has them (None: dynamic per-token scales)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    fixed: FixedScales | None = None


def row_scales(x: torch.Tensor, dtype: torch.dtype, fixed: float | None = None) -> torch.Tensor:
    """Scales of ``x`` ``[..., head_dim]`` (any float dtype) for ``dtype``: float32 ``[...]``,
    dynamic (amax / QMAX, 1 for an all-zero row) or ``fixed`` broadcast."""
    if fixed is not None:
        return torch.full(x.shape[:-1], fixed, dtype=SCALE_DTYPE, device=x.device)
    amax = x.float().abs().amax(dim=-1)
    return torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))


def quantize(
    x: torch.Tensor, dtype: torch.dtype, fixed: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (``dtype`` data of the same shape, float32 scales
    ``[...]``); see the module docstring for the rule."""
    if dtype not in QMAX:
        raise ValueError(f"not an 8-bit KV dtype: {dtype}")
    if fixed is not None and not (fixed > 0 and fixed < float("inf")):
        raise ValueError(f"a fixed KV scale must be positive and finite, got {fixed!r}")
    scale = row_scales(x, dtype, fixed)
    qmax = QMAX[dtype]
    y = (x.float() / scale.unsqueeze(-1)).clamp_(-qmax, qmax)
    if dtype is torch.int8:
        return torch.round(y).to(torch.int8), scale
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale``: data ``[..., head_dim]``, scales ``[...]``."""
    return q.float() * scale.unsqueeze(-1)
