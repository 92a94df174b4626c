"""What the native kernels' tests share: the loaded decode kernel."""

from __future__ import annotations

import pytest

from quire_engine.cpu import native
from tests.engine_tests.toolchain import require_native_kernels


@pytest.fixture(scope="module")
def kernel() -> native.PagedDecode:
    """The engine's native decode kernel (skips locally, fails in CI, when it cannot build)."""
    require_native_kernels()
    built = native.paged_decode()
    assert built is not None
    return built
