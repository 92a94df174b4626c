"""Start-up phases: ``StartupTimes`` on a scripted clock (exact seconds, the order, the refusals,
the log lines), the gauge ``quire_startup_seconds{phase}`` it feeds, and a real server's
``/metrics`` (the shared loopback server of ``conftest``), whose phases add up to at most
``ready``. And the CPU KV pool, which costs no memory (and no start-up time) until written."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from quire_engine.core.config import CacheConfig
from quire_engine.engine.metrics import EngineFacts, ServerMetrics
from quire_engine.engine.startup import StartupPhase, StartupTimes, process_age
from quire_engine.model.runner import zeroed
from tests.engine_tests.live_server import RunningServer


def scripted(*readings: float) -> Callable[[], float]:
    """A clock that returns ``readings`` in order (and fails the test if read once more)."""
    it: Iterator[float] = iter(readings)
    return lambda: next(it)


def test_phases_are_the_clock_differences_and_ready_counts_from_the_origin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="quire_engine.engine.startup")
    times = StartupTimes(scripted(10.0, 10.5, 12.0, 12.25, 12.5, 13.0, 20.0), origin=4.0)
    for phase in (StartupPhase.WEIGHTS, StartupPhase.KV_ALLOCATE, StartupPhase.WARMUP):
        with times.phase(phase):
            pass
    assert times.ready() == 16.0
    assert list(times.seconds.items()) == [
        (StartupPhase.WEIGHTS, 0.5),
        (StartupPhase.KV_ALLOCATE, 0.25),
        (StartupPhase.WARMUP, 0.5),
        (StartupPhase.READY, 16.0),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "startup phase weights: 0.500 s",
        "startup phase kv_allocate: 0.250 s",
        "startup phase warmup: 0.500 s",
        "startup: ready in 16.000 s (weights 0.500 s, kv_allocate 0.250 s, warmup 0.500 s)",
    ]


def test_the_default_origin_is_the_clock_at_creation() -> None:
    times = StartupTimes(scripted(100.0, 101.0, 103.0, 107.0))
    with times.phase(StartupPhase.KV_PROFILE):
        pass
    assert times.ready() == 7.0
    assert times.seconds[StartupPhase.KV_PROFILE] == 2.0


def test_a_phase_that_raises_is_not_recorded_and_may_run_again() -> None:
    times = StartupTimes(scripted(0.0, 1.0, 2.0, 5.0))  # origin, raising start, start, end
    with pytest.raises(RuntimeError), times.phase(StartupPhase.MODEL_CACHE):
        raise RuntimeError("cache never completed")
    assert dict(times.seconds) == {}
    with times.phase(StartupPhase.MODEL_CACHE):
        pass
    assert dict(times.seconds) == {StartupPhase.MODEL_CACHE: 3.0}


@pytest.mark.parametrize("misuse", ["twice", "nested", "ready_inside", "ready_as_phase"])
def test_a_phase_that_would_not_add_up_is_refused(misuse: str) -> None:
    times = StartupTimes(scripted(*range(10)))
    with times.phase(StartupPhase.WEIGHTS):
        if misuse == "nested":
            with pytest.raises(ValueError, match="inside phase weights"):
                times.phase(StartupPhase.WARMUP).__enter__()
        if misuse == "ready_inside":
            with pytest.raises(ValueError, match="ready inside phase weights"):
                times.ready()
    if misuse == "twice":
        with pytest.raises(ValueError, match="already recorded"):
            times.phase(StartupPhase.WEIGHTS).__enter__()
    if misuse == "ready_as_phase":
        with pytest.raises(ValueError, match="call ready"):
            times.phase(StartupPhase.READY).__enter__()
    assert list(times.seconds) == [StartupPhase.WEIGHTS]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_since_process_start_records_the_process_age_as_imports() -> None:
    assert (process_age() or -1.0) >= 0.0
    times = StartupTimes.since_process_start()
    assert list(times.seconds) == [StartupPhase.IMPORTS]
    assert times.seconds[StartupPhase.IMPORTS] >= 0.0
    assert times.ready() >= times.seconds[StartupPhase.IMPORTS]


def test_the_gauge_has_exactly_the_recorded_phases() -> None:
    metrics = ServerMetrics("m", vllm=True)
    startup = {StartupPhase.WEIGHTS: 1.5, StartupPhase.WARMUP: 0.25, StartupPhase.READY: 4.0}
    metrics.engine_ready(EngineFacts(64, CacheConfig(num_blocks=8), 0.9, 4.0, startup))
    exposed = {
        sample.labels["phase"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "quire_startup_seconds"
        for sample in family.samples
        if sample.labels["model_name"] == "m"
    }
    assert exposed == {"weights": 1.5, "warmup": 0.25, "ready": 4.0}
    names = {family.name for family in metrics.registry.collect()}
    assert not any("startup" in name for name in names if name.startswith("vllm:"))


def test_a_server_exports_every_phase_it_ran_and_they_add_up_to_at_most_ready(
    server: RunningServer,
) -> None:
    phases = {
        dict(labels)["phase"]: value
        for (name, labels), value in server.metrics().items()
        if name == "quire_startup_seconds"
    }
    # In-process: the engine's recorder counts from its creation, so no imports; nothing waits
    # for a model cache.
    assert set(phases) == {"weights", "kv_profile", "kv_allocate", "warmup", "ready"}
    assert all(value >= 0.0 for value in phases.values())
    assert sum(v for k, v in phases.items() if k != "ready") <= phases["ready"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_cpu_pool_is_zero_and_takes_memory_only_where_written() -> None:
    def resident_mib() -> float:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024

    before = resident_mib()
    pool = zeroed((1024, 16, 8, 128), torch.bfloat16, torch.device("cpu"))  # 512 MiB
    assert pool.shape == (1024, 16, 8, 128) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and pool.data_ptr() % 64 == 0
    assert resident_mib() - before < 64  # nothing written yet
    assert not bool(pool[::97].any())  # reads see zeros (and take no memory either)
    pool[7] = 1.5
    assert float(pool.sum()) == 1.5 * 16 * 8 * 128
    assert resident_mib() - before < 64
    assert torch.equal(zeroed((0, 4), torch.float32, torch.device("cpu")), torch.zeros(0, 4))


def test_the_engine_applies_and_logs_its_thread_count(caplog: pytest.LogCaptureFixture) -> None:
    from quire_engine.engine.llm import LLM

    caplog.set_level(logging.INFO, logger="quire_engine.engine.build")
    before = torch.get_num_threads()
    try:
        with LLM(device="cpu", num_blocks=32, max_model_len=64, threads=1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU threads")]
    assert line.startswith("CPU threads: 1 (from --threads; ")
    assert "; OpenMP waits: " in line
