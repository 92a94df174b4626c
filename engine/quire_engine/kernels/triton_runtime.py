"""Whether and how the Triton kernels can run in this process: the one place that imports triton.

Triton is optional: without it this module still imports, :data:`HAS_TRITON` is ``False``,
:func:`triton_usable` returns ``False`` and :func:`jit` leaves kernel bodies as plain functions
that the launchers never call (:func:`check_launchable` refuses first).

Tests run the Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``). In
triton 3.x the variable must be set before triton is imported: ``triton.jit`` picks compiled or
interpreted when it wraps a function, and triton's own helpers (``tl.max``, ``tl.sum``) are
wrapped when triton is imported. The kernel tests therefore run in a child process that starts
with the variable set (see ``tests/engine_tests/kernels/test_kernels.py``).
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
