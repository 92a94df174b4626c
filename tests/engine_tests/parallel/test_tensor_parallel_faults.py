"""A tensor-parallel rank that dies fails fast and loud: requests in flight and later ones get an
error, ``/health`` answers 503, and ``quire-engine serve`` exits non-zero; nothing hangs.

A worker killed during a step makes rank 0's next collective (or plan send) raise; one killed
while the engine is idle is found by the engine thread's health poll within about a second.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from tests.engine_tests.live_server import (
    EngineHolder,
    RunningServer,
    engine_process,
    serve,
    tiny_settings,
)
from tests.engine_tests.server.test_server_errors import error_of
from tests.engine_tests.server.test_server_faults import assert_everyone_answered, in_flight

TP = {"tensor_parallel_size": 2}


@pytest.fixture(params=[None], ids=["no-watchdog"])
def sharded(
    request: pytest.FixtureRequest, holder: EngineHolder, deaths: list[bool]
) -> Iterator[RunningServer]:
    """A TP=2 server of its own (``param``: its step timeout)."""
    settings = tiny_settings(
        engine=TP,
        engine_factory=holder,
        on_engine_death=lambda: deaths.append(True),
        step_timeout=request.param,
    )
    with serve(settings) as running:
        yield running


def _kill_worker(holder: EngineHolder, sig: signal.Signals = signal.SIGKILL) -> None:
    group = holder.engine.parallel
    assert group is not None
    (pid,) = group.pids
    assert pid is not None
    os.kill(pid, sig)


def test_a_rank_killed_mid_step_answers_everyone_and_turns_health_503(
    sharded: RunningServer, holder: EngineHolder, deaths: list[bool]
) -> None:
    join = in_flight(f"{sharded.base_url}/completions")
    sharded.wait_until(lambda: sharded.metric("quire_num_requests_running") == 6, "all running")
    _kill_worker(holder)
    assert_everyone_answered(join(), "engine_down")
    sharded.wait_until(lambda: bool(deaths), "death reported")
    assert error_of(httpx2.get(f"{sharded.url}/health"), 503)["type"] == "server_error"
    response = httpx2.post(f"{sharded.base_url}/completions", json={"prompt": "a"})
    assert error_of(response, 503)["code"] == "engine_down"


def test_a_rank_killed_while_idle_turns_health_503(
    sharded: RunningServer, holder: EngineHolder, deaths: list[bool]
) -> None:
    assert httpx2.get(f"{sharded.url}/health").status_code == 200
    _kill_worker(holder)
    sharded.wait_until(lambda: bool(deaths), "death reported")
    assert error_of(httpx2.get(f"{sharded.url}/health"), 503)["type"] == "server_error"


@pytest.mark.parametrize("sharded", [2.0], ids=["step-timeout-2s"], indirect=True)
def test_a_hung_rank_turns_health_503_and_answers_everyone(
    sharded: RunningServer, holder: EngineHolder, deaths: list[bool]
) -> None:
    """A stopped worker leaves rank 0 waiting in a collective: the step watchdog gives up."""
    join = in_flight(f"{sharded.base_url}/completions")
    sharded.wait_until(lambda: sharded.metric("quire_num_requests_running") == 6, "all running")
    _kill_worker(holder, signal.SIGSTOP)
    try:
        assert_everyone_answered(join(), "engine_hung")
        assert error_of(httpx2.get(f"{sharded.url}/health"), 503)["type"] == "server_error"
        assert deaths == [True]
    finally:
        _kill_worker(holder)  # rank 0's collective fails; its thread frees every block
        kv = holder.engine.scheduler.kv
        sharded.wait_until(lambda: kv.stats().used == 0, "blocks freed")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc: Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            # multiprocessing's spawned children, not its resource tracker
            if ppid == pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(int(entry.name))
    return found


def kill_mid_stream(base_url: str, pid: int) -> None:
    """Start a long stream, SIGKILL ``pid`` once it has begun, and expect the stream to end with
    the engine's death."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="tiny",
        prompt="keep going",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # streaming has begun
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="the engine loop died"):
        for _ in chunks:
            pass


@pytest.mark.slow
def test_serve_exits_nonzero_when_a_rank_dies_mid_stream(tmp_path: Path) -> None:
    with engine_process(tmp_path, "--tensor-parallel-size", "2", "--num-blocks", "256") as proc:
        proc.wait_ready(timeout=180)
        (worker,) = _children(proc.process.pid)
        kill_mid_stream(proc.base_url, worker)
        assert proc.wait_exit(timeout=60) == 1, proc.log()
    assert "tensor-parallel rank 1" in proc.log()
