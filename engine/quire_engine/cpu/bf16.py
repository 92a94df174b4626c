"""Whether this CPU computes in bfloat16 natively, and what the engine says about it at start.

A bf16 model on CPU (``--dtype bfloat16``) runs its matmuls through torch's bf16 linear, which
is oneDNN's: with AVX512-BF16 (``vdpbf16ps``) or AMX-BF16 (tile multiplies) its GEMM takes bf16
pairs natively, at about twice the float32 rate per instruction and half the bytes per weight.
Without either, oneDNN still serves bf16 by widening every element to float32 in software,
which is correct but slower than float32 itself: the engine serves anyway and warns.

Detection reads the CPU's own flags (``/proc/cpuinfo`` on Linux) and falls back to what torch's
oneDNN says (``torch.ops.mkldnn._is_mkldnn_bf16_supported``; it answers True on any AVX-512
CPU, native or not, so it only decides where the flags cannot be read).

Ownership: reads only; ``log_support`` is called once per engine build (rank 0 and each
tensor-parallel worker log their own CPU's support).
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The CPU flags (Linux's names) of native bf16 arithmetic.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")


class Source(enum.Enum):
    """Where the answer came from."""

    CPUINFO = "cpuinfo"  # the kernel's list of the CPU's flags
    ONEDNN = "onednn"  # torch's oneDNN build, where the flags cannot be read
    NONE = "none"  # neither: assumed absent


@dataclass(frozen=True, slots=True)
class Bf16Support:
    """The CPU's native bf16 flags (empty: none) and where that was read."""

    flags: tuple[str, ...]
    source: Source

    @property
    def native(self) -> bool:
        return bool(self.flags)


def parse_flags(cpuinfo: str) -> tuple[str, ...]:
    """The ``BF16_FLAGS`` that the first ``flags`` line of a ``/proc/cpuinfo`` text lists."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return tuple(f for f in BF16_FLAGS if f in present)
    return ()


@functools.cache
def support() -> Bf16Support:
    """This CPU's native bf16 support (read once per process)."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        text = ""
    if "flags" in text:
        return Bf16Support(parse_flags(text), Source.CPUINFO)
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return Bf16Support((), Source.NONE)
    return Bf16Support(("onednn_bf16",) if onednn else (), Source.ONEDNN)


def log_support(device: torch.device, dtype: torch.dtype) -> Bf16Support | None:
    """For a bf16 model on CPU: log the CPU's bf16 support, or warn that without it bf16 is
    served but slow; None (nothing logged) for any other device or dtype."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    found = support()
    if found.native:
        logger.info(
            "bf16 on CPU: native (%s, from %s); matmuls through oneDNN's bf16 GEMM, decode "
            "attention through the native kernel on the bf16 or 8-bit pool",
            ", ".join(found.flags),
            found.source.value,
        )
    else:
        logger.warning(
            "bf16 on CPU: this CPU has none of %s (from %s); serving bf16 anyway, with every "
            "matmul widened to float32 in software: expect it slower than --dtype float32",
            ", ".join(BF16_FLAGS),
            found.source.value,
        )
    return found
