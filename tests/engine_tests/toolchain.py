"""What the native CPU kernels' tests need from the machine: a C compiler."""

from __future__ import annotations

import os

import pytest

from quire_engine.cpu import native


def require_native_kernels() -> None:
    """Skip (locally) or fail (in CI, where a C compiler is always installed: Triton needs one)
    when the native CPU kernels cannot be built."""
    if native.library() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must build the native CPU kernels (is a C compiler installed?)")
        pytest.skip("no C compiler here to build the native CPU kernels")
