"""Moving K/V in and between paged caches: slot writes, block copies (copy-on-write) and swaps.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``, and for an
8-bit pool its scales ``[num_blocks, block_size, num_kv_heads]`` float32 (``kv_quant``). A *slot*
names one token position of the pool: ``slot = block_id * block_size + offset``.

- :func:`write_kv`: scatter the step's new K/V ``[num_tokens, kv_heads, head_dim]`` into their
  slots, quantizing them in the same pass when the pool is 8-bit (their scales go to the same
  slots of the scale pools). A Triton kernel on CUDA (one program per token), ``index_put_``
  elsewhere.
- :func:`copy_blocks`: ``dst <- src`` block copies inside each layer's pool, for copy-on-write
  when a shared last block is about to be written by one of its owners.
- :func:`swap_blocks`: block copies between two pools of the same block shape on different
  devices (GPU <-> CPU) for swap-out / swap-in preemption.

Both copies take any list of block-major tensors (dimension 0 is the block id): the runner
passes the scale pools beside the data pools, so a block's scales move with its bytes.

The copies are whole-block gathers/scatters with torch indexing: one kernel per layer and
tensor, already bandwidth-bound, so a custom kernel would buy nothing.
"""

from __future__ import annotations

import math

import torch

from quire_engine.kernels.kv_quant import QMAX, FixedScales, quantize
from quire_engine.kernels.triton_runtime import HAS_TRITON, check_launchable, jit, triton_usable

if HAS_TRITON:
    import triton.language as tl


@jit
def _round_to_grid(y, MANT_BITS: tl.constexpr, MIN_STEP: tl.constexpr):  # type: ignore[no-untyped-def]
    """``y`` fp32 (any shape, within the format's range) rounded half to even onto the 8-bit
    format's grid, still fp32, so the cast that follows is exact. A value of magnitude in
    [2^e, 2^(e+1)) has the grid step 2^(e - MANT_BITS), never below MIN_STEP (the subnormal
    step; int8: 1). Adding 1.5 * 2^23 steps puts the sum where fp32's own spacing is one step,
    so the add rounds |y| to the grid half to even, and the subtraction is exact.

    Why not ``y.to(fp8, fp_downcast_rounding="rtne")``: Triton's interpreter rounds fp8 casts
    half up and mishandles steps across a binade or into subnormals, so the CPU tests could not
    check the rule; and int8 has no rounding cast at all."""
    a = tl.abs(y)
    pow2 = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2^e
    step = tl.maximum(pow2 * (2.0**-MANT_BITS), MIN_STEP)
    magic = step * 12582912.0  # 1.5 * 2^23 steps: exact (powers of two times 1.5)
    r = (a + magic) - magic
    # The sign back, -0 included (a negative value that rounds to zero casts to -0).
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)


@jit
def _quantize_rows(  # type: ignore[no-untyped-def]
    x,  # fp32 [HEADS_PAD, HEAD_DIM_PAD], padded lanes 0
    fixed,  # fp32 scalar: the checkpoint scale, used with HAS_FIXED only
    QMAX: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_STEP: tl.constexpr,
    HAS_FIXED: tl.constexpr,
):
    """kv_quant's write rule per (token, head) row: (x / scale clamped to ±QMAX and rounded
    onto the format's grid, fp32 [HEADS_PAD, HEAD_DIM_PAD]; scale fp32 [HEADS_PAD]). Divisions
    are IEEE (div_rn), as torch's are: ``a / b`` is an approximate division on NVIDIA GPUs."""
    if HAS_FIXED:
        scale = tl.zeros([x.shape[0]], dtype=tl.float32) + fixed
    else:
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, QMAX), 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    return _round_to_grid(y, MANT_BITS, MIN_STEP), scale


@jit
def _write_kv_kernel(  # type: ignore[no-untyped-def]  # annotations mean types to Triton
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same layout as k_cache
    slot_mapping_ptr,  # int64 [num_tokens]
    k_scale_ptr,  # fp32 [num_blocks, block_size, num_kv_heads]; 8-bit caches (QUANT) only
    v_scale_ptr,  # same layout as k_scale
    k_fixed, v_fixed,  # fp32 checkpoint scales; used with HAS_FIXED only
    stride_kt, stride_kh, stride_vt, stride_vh,  # key, value: token, head
    stride_kcb, stride_kct, stride_kch,  # k_cache: block, slot, head
    stride_vcb, stride_vct, stride_vch,  # v_cache
    stride_ksb, stride_kst, stride_ksh,  # k_scale: block, slot, head
    stride_vsb, stride_vst, stride_vsh,  # v_scale
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two (tl.arange needs one)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr,  # an 8-bit cache: quantize each (token, head) row, store its scale
    HAS_FIXED: tl.constexpr,  # 8-bit with the checkpoint's scales instead of amax / QMAX
    QMAX: tl.constexpr,  # the 8-bit format's largest magnitude; the next two: its grid
    MANT_BITS: tl.constexpr,
    MIN_STEP: tl.constexpr,
):  # fmt: skip
    # One program per token moves all its heads: [HEADS_PAD, HEAD_DIM_PAD] of K and of V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)  # int64, so block * stride cannot overflow
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask
    )
    if QUANT:
        head_ok = heads < NUM_KV_HEADS
        k, k_s = _quantize_rows(k.to(tl.float32), k_fixed, QMAX, MANT_BITS, MIN_STEP, HAS_FIXED)
        v, v_s = _quantize_rows(v.to(tl.float32), v_fixed, QMAX, MANT_BITS, MIN_STEP, HAS_FIXED)
        tl.store(
            k_scale_ptr + block * stride_ksb + offset * stride_kst + heads * stride_ksh,
            k_s,
            mask=head_ok,
        )
        tl.store(
            v_scale_ptr + block * stride_vsb + offset * stride_vst + heads * stride_vsh,
            v_s,
            mask=head_ok,
        )
    tl.store(
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kct
        + heads[:, None] * stride_kch
        + dims[None, :],
        k.to(k_cache_ptr.dtype.element_ty),  # 8-bit: exact, the values lie on the grid
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vct
        + heads[:, None] * stride_vch
        + dims[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def _write_config(
    cache_dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int, fixed: bool
) -> dict[str, object]:
    """Constexprs of ``_write_kv_kernel`` for a cache of ``cache_dtype``. The 8-bit grid comes
    from torch's own description of the format: fp8 steps are 2^-MANT_BITS of the binade
    (``finfo.eps``), subnormals step ``smallest_normal * eps``; int8 steps by 1 (MANT_BITS 7:
    every |x| <= 127 lies below 2^7)."""
    quant = cache_dtype in QMAX
    mant_bits, min_step = 7, 1.0
    if quant and cache_dtype.is_floating_point:
        info = torch.finfo(cache_dtype)
        mant_bits, min_step = round(-math.log2(info.eps)), info.smallest_normal * info.eps
    return {
        "BLOCK_SIZE": block_size, "NUM_KV_HEADS": num_kv_heads,
        "HEADS_PAD": 1 << (num_kv_heads - 1).bit_length(), "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": 1 << (head_dim - 1).bit_length(), "QUANT": quant,
        "HAS_FIXED": quant and fixed, "QMAX": QMAX.get(cache_dtype, 0.0),
        "MANT_BITS": mant_bits, "MIN_STEP": min_step,
    }  # fmt: skip


def _check_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    want = (slot_mapping.shape[0], *k_cache.shape[2:])
    if key.shape != want or value.shape != want:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_dim] = {want}, "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError(
            f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if key.dtype != value.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"key and value ({key.dtype}, {value.dtype}) and the caches ({k_cache.dtype}, "
            f"{v_cache.dtype}) must each share one dtype"
        )
    scales = [t for t in (k_scale, v_scale) if t is not None]
    if k_cache.dtype in QMAX:
        want_scale = k_cache.shape[:3]
        if len(scales) != 2 or any(
            t.shape != want_scale or t.dtype != torch.float32 for t in scales
        ):
            raise ValueError(
                f"an 8-bit {k_cache.dtype} cache needs float32 k_scale and v_scale of shape "
                f"{tuple(want_scale)}"
            )
    elif scales:
        raise ValueError(f"scales belong to 8-bit caches, not to a {k_cache.dtype} one")
    elif key.dtype != k_cache.dtype:
        raise ValueError(f"key ({key.dtype}) and the caches ({k_cache.dtype}) must share a dtype")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping, *scales)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        capacity = k_cache.shape[0] * k_cache.shape[1]
        if not 0 <= int(slot_mapping.min()) <= int(slot_mapping.max()) < capacity:
            raise ValueError(f"slot_mapping holds slots outside [0, {capacity})")


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fixed: FixedScales | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into their slots, in place;
    into an 8-bit cache quantized (``kv_quant.quantize``: dynamic per-row scales, or the
    ``fixed`` checkpoint scales), each row's scale into the same slot of ``k_scale`` /
    ``v_scale``.

    Indexing (block, offset) pairs rather than a flattened view works for any cache strides."""
    _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]
    index = (slot_mapping // block_size, slot_mapping % block_size)
    if k_scale is None or v_scale is None:
        k_cache.index_put_(index, key)
        v_cache.index_put_(index, value)
        return
    for x, cache, scales, fixed_scale in (
        (key, k_cache, k_scale, None if fixed is None else fixed.k),
        (value, v_cache, v_scale, None if fixed is None else fixed.v),
    ):
        q, s = quantize(x, cache.dtype, fixed_scale)
        cache.index_put_(index, q)
        scales.index_put_(index, s)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fixed: FixedScales | None = None,
) -> None:
    """The Triton launcher behind :func:`write_kv` (CUDA, or CPU under TRITON_INTERPRET=1):
    the same bytes and scales as :func:`write_kv_reference`, 8-bit caches included."""
    _check_write(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride {t.stride(-1)})")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    quant = k_scale is not None
    if quant and fixed is not None and not all(0 < f < math.inf for f in fixed):
        # kv_quant.quantize's check, so both paths refuse the same scales
        raise ValueError(f"a fixed KV scale must be positive and finite, got {fixed!r}")
    check_launchable(key.device, "write_kv")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    has_fixed = quant and fixed is not None  # (the reference ignores them for other caches)
    config = _write_config(k_cache.dtype, block_size, num_kv_heads, head_dim, has_fixed)
    # The fixed scales rounded to float32, as kv_quant's torch.full stores them.
    k_fixed, v_fixed = torch.tensor(fixed or (1.0, 1.0), dtype=torch.float32).tolist()
    ks = (0, 0, 0) if k_scale is None else k_scale.stride()
    vs = (0, 0, 0) if v_scale is None else v_scale.stride()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_fixed, v_fixed,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *ks, *vs, **config,
    )  # fmt: skip


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fixed: FixedScales | None = None,
) -> None:
    """Write new K/V into their slots (quantizing into an 8-bit cache, see
    ``write_kv_reference``): the Triton kernel on CUDA, ``index_put_`` elsewhere."""
    write = write_kv_triton if triton_usable(key.device) else write_kv_reference
    write(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, fixed=fixed)


def _pair_indices(
    pairs: list[tuple[int, int]], num_src: int, num_dst: int
) -> tuple[list[int], list[int]]:
    """Split (src, dst) pairs into index lists, checking ranges and that no dst repeats (two
    copies into one block would leave it undefined)."""
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    bad = [(s, d) for s, d in pairs if not (0 <= s < num_src and 0 <= d < num_dst)]
    if bad:
        raise ValueError(f"block pairs {bad} out of range (src < {num_src}, dst < {num_dst})")
    if len(set(dst)) != len(dst):
        raise ValueError(f"destination blocks repeat in {pairs}")
    return src, dst


def _check_layers(
    a: list[torch.Tensor], b: list[torch.Tensor], names: tuple[str, str], same_device: bool
) -> None:
    if len(a) != len(b):
        raise ValueError(f"{names[0]} has {len(a)} layers, {names[1]} has {len(b)}")
    for layer, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.dim() < 2 or x.shape[1:] != y.shape[1:] or x.dtype != y.dtype:
            raise ValueError(
                f"layer {layer}: {names[0]} {tuple(x.shape)} {x.dtype} and {names[1]} "
                f"{tuple(y.shape)} {y.dtype} must be block-major pools of one block shape and "
                "dtype"
            )
        if same_device and x.device != y.device:
            raise ValueError(f"layer {layer}: {names[0]} on {x.device}, {names[1]} on {y.device}")


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """In every layer copy block ``src`` to block ``dst`` for each ``(src, dst)`` in ``pairs``.

    All sources are read before any destination is written, so a block may be both the source
    of one pair and the destination of another."""
    _check_layers(k_caches, v_caches, ("k_caches", "v_caches"), same_device=True)
    if not pairs or not k_caches:
        return
    num_blocks = k_caches[0].shape[0]
    if any(c.shape[0] != num_blocks for c in (*k_caches, *v_caches)):
        raise ValueError("every layer's cache must hold the same number of blocks")
    src, dst = _pair_indices(pairs, num_blocks, num_blocks)
    device = k_caches[0].device
    src_idx = torch.tensor(src, dtype=torch.long, device=device)
    dst_idx = torch.tensor(dst, dtype=torch.long, device=device)
    for cache in (*k_caches, *v_caches):
        cache[dst_idx] = cache[src_idx]  # the gather makes a copy before the scatter


def swap_blocks(
    src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """Copy block ``src`` of ``src_caches[i]`` to block ``dst`` of ``dst_caches[i]`` for every
    layer ``i``; the two pools may live on different devices (swap out: GPU -> CPU, swap in:
    CPU -> GPU). Pass the K caches and the V caches as separate calls or concatenated lists."""
    _check_layers(src_caches, dst_caches, ("src_caches", "dst_caches"), same_device=False)
    if not pairs or not src_caches:
        return
    src, dst = _pair_indices(pairs, src_caches[0].shape[0], dst_caches[0].shape[0])
    for s_cache, d_cache in zip(src_caches, dst_caches, strict=True):
        if s_cache.shape[0] != src_caches[0].shape[0] or d_cache.shape[0] != dst_caches[0].shape[0]:
            raise ValueError("every layer's pool on one side must hold the same number of blocks")
    src_idx = torch.tensor(src, dtype=torch.long, device=src_caches[0].device)
    dst_idx = torch.tensor(dst, dtype=torch.long, device=dst_caches[0].device)
    for s_cache, d_cache in zip(src_caches, dst_caches, strict=True):
        # Gather on the source device (one contiguous [n, block...] tensor), move it in one
        # transfer, scatter on the destination device.
        d_cache[dst_idx] = s_cache[src_idx].to(d_cache.device)
