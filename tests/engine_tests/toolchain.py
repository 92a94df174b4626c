"""What the native CPU kernels' tests need from the machine: a C compiler (and, for the
AddressSanitizer test, its ASan runtime)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

from quire_engine.cpu import native

# The warnings every csrc file must compile without (test_native_builds.py).
WARNING_FLAGS = ("-Wall", "-Wextra", "-Werror")


def _missing(what: str) -> NoReturn:
    """Skip locally, fail in CI (where a C compiler is always installed: Triton needs one)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have {what}")
    pytest.skip(f"no {what} here")


def require_native_kernels() -> None:
    """Skip (locally) or fail (in CI) when the native CPU kernels cannot be built."""
    if native.library() is None:
        _missing("a C compiler to build the native CPU kernels")


def require_compiler() -> str:
    """The C compiler native.py builds with; skip (locally) or fail (in CI) without one."""
    cc = native.compiler()
    if cc is None:
        _missing("a C compiler (set CC, or install gcc)")
    return cc


def asan_runtime(cc: str) -> Path:
    """The compiler's shared AddressSanitizer runtime (to LD_PRELOAD into a Python child);
    skip (locally) or fail (in CI) when the compiler has none."""
    try:
        done = subprocess.run(
            [cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=60
        )
        path = Path(done.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        path = Path("libasan.so")
    if not path.is_absolute() or not path.is_file():
        _missing(f"AddressSanitizer runtime for {cc} (libasan)")
    return path.resolve()
