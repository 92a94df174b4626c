"""GPU kernels of the engine and their pure-torch references.

Each kernel file holds the ``@triton.jit`` body, a launcher that checks dtypes, shapes, strides and
the grid, and a torch reference with identical semantics:

- :mod:`.paged_attention`: varlen causal attention over a paged KV cache (prefill, prefill with a
  cached prefix, chunked prefill and decode in one code path), split-KV for long contexts.
- :mod:`.kv_cache_ops`: writing new K/V into their slots, block copies (copy-on-write) and swaps
  between a GPU and a CPU pool.

Device policy: on CUDA the engine runs the Triton kernels; on CPU it runs the torch references,
which are batched to be fast (they are the CPU execution path, not only a test oracle), except
decode attention over fp32 pools, which goes through :mod:`quire_engine.cpu.native` (a C kernel
compiled on first use that reads blocks in place) when a C compiler can build it. Triton is
optional: without it this package still imports and :func:`triton_usable` returns ``False``.

Tests run the Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``). In
triton 3.x the variable must be set before triton is imported: ``triton.jit`` picks compiled or
interpreted when it wraps a function, and triton's own helpers (``tl.max``, ``tl.sum``) are
wrapped when triton is imported. The kernel tests therefore run in a child process that starts
with the variable set (see ``tests/engine_tests/test_kernels.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the torch references are all the engine needs there
    triton = None

HAS_TRITON: bool = triton is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``), read right now."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Whether this process's kernels were wrapped for the interpreter: fixed when triton and the
# kernel modules are imported, whatever the variable says later.
INTERPRETED: bool = HAS_TRITON and interpreting()


def triton_usable(device: torch.device | str) -> bool:
    """Whether the engine should run the Triton kernels on ``device``.

    True on a CUDA device when triton imports and CUDA is available. False on CPU, where the
    engine runs the torch references, and in a process whose kernels were wrapped for the
    interpreter (``TRITON_INTERPRET=1``: a test tool, far too slow to serve with).
    """
    dev = torch.device(device)
    return HAS_TRITON and not INTERPRETED and dev.type == "cuda" and torch.cuda.is_available()


def check_launchable(device: torch.device, what: str) -> None:
    """Raise ValueError unless a Triton kernel can run on tensors of ``device`` right now."""
    if not HAS_TRITON:
        raise ValueError(f"{what}: triton is not installed; use the torch reference instead")
    if device.type == ("cpu" if INTERPRETED else "cuda"):
        return
    raise ValueError(
        f"{what}: tensors are on {device}; the Triton kernel needs CUDA tensors, or CPU tensors "
        "under the interpreter (TRITON_INTERPRET=1 set before triton is imported, for tests); "
        "use the torch reference on CPU"
    )


def jit(fn: Callable[..., None]) -> Any:
    """``triton.jit`` where triton imports; elsewhere the plain function, never launched (the
    launchers refuse first, in :func:`check_launchable`)."""
    return triton.jit(fn) if triton is not None else fn


# The submodules import the helpers above from this partially initialised package, so these
# imports must come after them.
from quire_engine.kernels.kv_cache_ops import (  # noqa: E402
    copy_blocks,
    swap_blocks,
    write_kv,
    write_kv_reference,
    write_kv_triton,
)
from quire_engine.kernels.paged_attention import (  # noqa: E402
    LayerAttention,
    PagedAttentionInputs,
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)

__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "LayerAttention",
    "PagedAttentionInputs",
    "check_launchable",
    "choose_num_splits",
    "copy_blocks",
    "interpreting",
    "jit",
    "paged_attention",
    "paged_attention_reference",
    "swap_blocks",
    "triton_usable",
    "write_kv",
    "write_kv_reference",
    "write_kv_triton",
]
