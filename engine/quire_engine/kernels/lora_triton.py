"""The batched LoRA update on CUDA: a Triton shrink and expand pair over per-token adapter slots
(punica's BGMV shape, as vLLM's LoRA kernels), with torch references of the same semantics.

For a step's packed tokens x [T, in] and each token's slot ``slots`` [T] (int32; -1: the base
model, no update), with the slots' stacked A [S, R, in] and scaled B [S, out, R] (``model/lora``
zero-pads every adapter to the slots' rank R):

- ``lora_shrink``: t[i] = A[slots[i]] @ x[i]           -> t [T, R] (float32; zeros for -1)
- ``lora_expand``: y[i] += B[slots[i]] @ t[i]          -> y [T, out], in place (untouched for -1)

One program per (token, tile of outputs) reads its token's slot and streams that slot's rows of
A or B; accumulation is in float32 whatever the model's dtype. Tokens of the base model exit at
once, so a step with few adapter tokens costs little beyond the launch. The kernels run on CUDA
(``triton_usable``) and, for the tests, in Triton's CPU interpreter against the references.
"""

from __future__ import annotations

from typing import Any

import torch

from quire_engine.kernels.triton_runtime import HAS_TRITON, check_launchable, jit

if HAS_TRITON:
    import triton
    import triton.language as tl

BLOCK_N = 32  # outputs per program
BLOCK_K = 64  # inputs per loop step


@jit
def _lora_shrink_kernel(  # type: ignore[no-untyped-def]  # annotations mean types to Triton
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    in_features,
    rank,
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_out,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # rank rows of A
    row_ok = rows < rank
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, in_features, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < in_features
            x = tl.load(x_ptr + token * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
            a_rows = a_ptr + slot * stride_a_slot + rows[:, None] * stride_a_row + cols[None, :]
            a = tl.load(a_rows, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_out + rows, acc, mask=row_ok)


@jit
def _lora_expand_kernel(  # type: ignore[no-untyped-def]
    t_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    out_features,
    rank,
    stride_t,
    stride_b_slot,
    stride_b_row,
    stride_y,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # the rank rounded up to a power of two (>= 16)
):
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
        row_ok = rows < out_features
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        t = tl.load(t_ptr + token * stride_t + ranks, mask=rank_ok, other=0.0)
        b_rows = b_ptr + slot * stride_b_slot + rows[:, None] * stride_b_row + ranks[None, :]
        b = tl.load(b_rows, mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * t[None, :], axis=1)
        y_at = y_ptr + token * stride_y + rows
        y = tl.load(y_at, mask=row_ok, other=0.0)
        tl.store(y_at, (y.to(tl.float32) + delta).to(y.dtype), mask=row_ok)


def _check(x: torch.Tensor, stacked: torch.Tensor, slots: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or stacked.dim() != 3 or slots.shape != (x.shape[0],):
        raise ValueError(
            f"{what}: x [T, features], stacked [S, rows, cols], slots [T]; got "
            f"{tuple(x.shape)}, {tuple(stacked.shape)}, {tuple(slots.shape)}"
        )


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    _check(x, a, slots, "lora_shrink")
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = (slots == slot).nonzero().squeeze(1)
            out[rows] = x[rows].float() @ a[slot].float().T
    return out


def lora_expand_reference(
    y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    _check(y, b, slots, "lora_expand")
    for slot in slots.unique().tolist():
        if slot >= 0:
            rows = (slots == slot).nonzero().squeeze(1)
            y[rows] = (y[rows].float() + t[rows] @ b[slot].float().T).to(y.dtype)
    return y


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """t [T, R] float32 (see the module docstring), by the Triton kernel."""
    _check(x, a, slots, "lora_shrink")
    check_launchable(x.device, "lora_shrink")
    if x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError("lora_shrink: x and A must be contiguous in their last dimension")
    tokens, rank = x.shape[0], a.shape[1]
    out = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out
    grid: Any = (tokens, triton.cdiv(rank, BLOCK_N))
    _lora_shrink_kernel[grid](
        x, a, slots.to(torch.int32), out, x.shape[1], rank,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """y [T, out] plus each token's update, in place (see the module docstring)."""
    _check(y, b, slots, "lora_expand")
    check_launchable(y.device, "lora_expand")
    if y.stride(1) != 1 or b.stride(2) != 1 or t.dtype != torch.float32:
        raise ValueError("lora_expand: y and B contiguous in their last dimension, t float32")
    tokens, rank = y.shape[0], b.shape[2]
    if tokens == 0:
        return y
    grid: Any = (tokens, triton.cdiv(y.shape[1], BLOCK_N))
    _lora_expand_kernel[grid](
        t.contiguous(), b, slots.to(torch.int32), y, y.shape[1], rank,
        t.shape[1], b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )  # fmt: skip
    return y
