"""Shutdown without loss, on a real ``quire-engine serve`` process (issue 10, section 2).

SIGTERM with 16 streams in flight: ``/ready`` turns 503 at once, a new request gets 503
``shutting_down`` with ``Retry-After`` while ``/health`` stays 200, the streams finish within
``--shutdown-timeout`` (or, past it, end with an error event and ``[DONE]``), and the process
exits 0. An engine that dies answers the request in flight and exits 1.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.engine_tests.live_server import (
    EngineProcess,
    engine_process,
    serve,
    sse_payloads,
    tiny_settings,
)
from tests.waiting import wait_until

STREAMS = 16


def start_streams(url: str, body: dict[str, Any]) -> tuple[threading.Event, Callable[[], Any]]:
    """``STREAMS`` concurrent streams of ``body``; the event is set once every one of them has
    received its first event (so all are in flight), the function joins and returns payloads."""
    started = threading.Event()
    results: list[list[list[Any]]] = []

    async def one(client: httpx2.AsyncClient, counter: list[int]) -> list[Any]:
        lines: list[str] = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) == 1:
                    counter[0] += 1
                    if counter[0] == STREAMS:
                        started.set()
        return sse_payloads(lines)

    async def all_streams() -> list[list[Any]]:
        counter = [0]
        async with httpx2.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, counter) for _ in range(STREAMS)))

    thread = threading.Thread(target=lambda: results.append(asyncio.run(all_streams())))
    thread.start()

    def join() -> list[list[Any]]:
        thread.join(timeout=300)
        assert results, "the streams never ended"
        return results[0]

    return started, join


def assert_refuses_new_work(proc: EngineProcess) -> None:
    def ready_status() -> int:
        return httpx2.get(f"{proc.url}/ready").status_code

    wait_until(  # at once, in practice: the first poll
        ready_status,
        until=lambda status: status == 503,
        timeout=30.0,
        interval=0.02,
        message=lambda: f"/ready never turned 503\n{proc.log()}",
    )
    assert httpx2.get(f"{proc.url}/health").status_code == 200  # draining, not dead
    refused = httpx2.post(f"{proc.base_url}/completions", json={"prompt": "late", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert int(refused.headers["retry-after"]) > 0


@pytest.mark.slow
def test_sigterm_lets_16_streams_finish_then_exits_0(tmp_path: Path) -> None:
    body = {"prompt": "drain me", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with engine_process(tmp_path, "--shutdown-timeout", "240", "--num-blocks", "256") as proc:
        proc.wait_ready()
        started, join = start_streams(proc.url, {**body, "stream": True})
        assert started.wait(timeout=120), proc.log()
        proc.process.send_signal(signal.SIGTERM)
        assert_refuses_new_work(proc)
        streams = join()
        assert proc.wait_exit() == 0, proc.log()
    for events in streams:  # every stream complete: its last chunk says "length", then DONE
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in events[:-1])
    assert "drained in" in proc.log()


def test_streams_open_at_the_shutdown_timeout_end_with_an_error_event() -> None:
    # In-process (the signal plumbing is the test above): the same drain, with a deadline that
    # 1,500-token streams cannot meet on a CPU.
    body = {"prompt": "never done", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    settings = tiny_settings({"max_model_len": 2048, "num_blocks": 2048}, shutdown_timeout=0.5)
    with serve(settings) as srv:
        started, join = start_streams(srv.url, {**body, "stream": True})
        assert started.wait(timeout=120)
        assert srv.drain() == STREAMS
        streams = join()
        assert httpx2.get(f"{srv.url}/ready").json()["error"]["code"] == "shutting_down"
        srv.wait_until_idle()  # ended streams are aborted in the engine: every block is back
    for events in streams:
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"


BROKEN_FORWARD = """
from quire_engine.model import runner as model_runner
_real = model_runner.ModelRunner.execute
_calls = [0]
def _execute(self, out):
    _calls[0] += 1
    if _calls[0] > 2:  # the warm-up takes two steps; the first real request's step fails
        raise RuntimeError("injected forward failure")
    return _real(self, out)
model_runner.ModelRunner.execute = _execute
"""


@pytest.mark.slow
def test_an_engine_that_dies_answers_and_exits_1(tmp_path: Path) -> None:
    with engine_process(tmp_path, prelude=BROKEN_FORWARD) as proc:
        proc.wait_ready()
        body = {"prompt": "x", "max_tokens": 4}
        response = httpx2.post(f"{proc.base_url}/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_down"
        assert proc.wait_exit() == 1, proc.log()
    assert "injected forward failure" in proc.log()
