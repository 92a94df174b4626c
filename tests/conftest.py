"""What every test session needs.

- The control-plane fixtures (``binaries``, ``cluster``, ``namespace``, ``crds``, ``operators``)
  live in the plugin tests/cluster/pytest_plugin.py, loaded here because pytest accepts
  ``pytest_plugins`` only in the top-level conftest; the operator and e2e tests use them.
- Tests marked ``gpu`` skip, through the one hook below, when CUDA is absent.

The engine tests' own fixtures (the "every block free after each test" check among them) are in
tests/engine_tests/conftest.py.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["tests.cluster.pytest_plugin"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``gpu`` test skips without CUDA (torch is imported only if one was collected)."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_tests:
        item.add_marker(skip)
