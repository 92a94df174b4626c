"""Faults behind the HTTP API (issue 10): a request that fails inside the engine gets an error
(500 in OpenAI's shape, or an error event on its stream) while the others go on; a failing model
forward or a hanging step kills the engine, and then every pending request is answered and
``/health`` turns 503; unhandled exceptions answer in OpenAI's shape; tokenization runs off the
event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.engine import llm_engine as engine_module
from quire_engine.model.sampler import SampleRow
from quire_engine.server import job as server_job
from quire_engine.server import prompt_encoder
from tests.engine_tests.live_server import (
    EngineHolder,
    RunningServer,
    serve,
    sse_payloads,
    tiny_settings,
)
from tests.engine_tests.server.test_server_errors import error_of, still_serving

POISON_SEED = 424_242
LONG = {"prompt": "keep going", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def poisoned_sample(real: Callable[..., Any]) -> Callable[..., Any]:
    def sample(logits: Any, rows: list[SampleRow]) -> Any:
        if any(r.params.seed == POISON_SEED for r in rows):
            raise RuntimeError("injected sampling fault")
        return real(logits, rows)

    return sample


async def post_all(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """Each body POSTed concurrently: (status, JSON body or the SSE payload list)."""

    async def one(client: httpx2.AsyncClient, body: dict[str, Any]) -> tuple[int, Any]:
        async with client.stream("POST", url, json=body) as response:
            if body.get("stream") and response.status_code == 200:
                return 200, sse_payloads([line async for line in response.aiter_lines()])
            await response.aread()
            return response.status_code, response.json()

    async with httpx2.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, b) for b in bodies))


def test_a_sampling_fault_fails_only_its_request(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{server.base_url}/completions"
    healthy = {"prompt": "healthy", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    # The clean run is batched differently from the faulted one: its greedy path must have no
    # near-tie, or float rounding alone could change it.
    reference = LLM(device="cpu", num_blocks=16, max_model_len=64).generate(
        "healthy", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    )[0]
    for step in reference.outputs[0].logprobs or []:
        best, second = sorted(step.values(), reverse=True)[:2]
        assert best - second > 1e-3, "the test prompt has a near-tie: pick another"
    clean = httpx2.post(url, json=healthy).json()["choices"][0]["text"]
    assert clean == reference.outputs[0].text
    monkeypatch.setattr(engine_module, "sample", poisoned_sample(engine_module.sample))
    before = server.metrics()
    bad = {"prompt": "poisoned", "max_tokens": 12, "temperature": 1.0, "seed": POISON_SEED}
    results = asyncio.run(
        post_all(url, [healthy, bad, {**bad, "stream": True}, {**healthy, "stream": True}])
    )
    (ok_status, ok), (bad_status, bad_body), (_, bad_events), (_, ok_events) = results
    assert ok_status == 200 and ok["choices"][0]["text"] == clean
    assert "".join(e["choices"][0]["text"] for e in ok_events[:-1] if e["choices"]) == clean
    assert ok_events[-1] == "[DONE]"
    assert bad_status == 500
    assert bad_body["error"]["type"] == "server_error"
    assert bad_body["error"]["code"] == "request_failed"
    assert "injected sampling fault" in bad_body["error"]["message"]
    # The stream: the failed choice's last chunk says "abort", then an error event, then DONE.
    *chunks, error, done = bad_events
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert error["error"]["code"] == "request_failed" and done == "[DONE]"
    after = server.wait_until_idle()
    key = ("quire_request_success_total", (("finished_reason", "abort"),))
    assert after[key] - before[key] == 2
    still_serving(server)


def in_flight(url: str) -> Callable[[], list[tuple[int, Any]]]:
    """Start 4 streams and 2 plain requests that run for a long time; returns a join function."""
    bodies = [{**LONG, "stream": True}] * 4 + [LONG] * 2
    results: list[list[tuple[int, Any]]] = []
    thread = threading.Thread(target=lambda: results.append(asyncio.run(post_all(url, bodies))))
    thread.start()

    def join() -> list[tuple[int, Any]]:
        thread.join(timeout=120)
        assert results, "the requests were never answered"
        return results[0]

    return join


@pytest.fixture(params=[None], ids=["no-watchdog"])
def fragile(
    request: pytest.FixtureRequest, holder: EngineHolder, deaths: list[bool]
) -> Iterator[RunningServer]:
    """A server of its own whose engine the test may break (``param``: its step timeout)."""
    settings = tiny_settings(
        engine_factory=holder,
        on_engine_death=lambda: deaths.append(True),
        step_timeout=request.param,
    )
    with serve(settings) as running:
        yield running


def assert_everyone_answered(results: list[tuple[int, Any]], code: str) -> None:
    for status, body in results:
        if isinstance(body, list):  # a stream: it ends with an error event and DONE
            assert status == 200 and body[-1] == "[DONE]"
            assert body[-2]["error"]["code"] == code, body[-2]
        else:
            assert status == 503 and body["error"]["code"] == code, body


def test_a_failing_forward_kills_the_engine_and_answers_everyone(
    fragile: RunningServer,
    holder: EngineHolder,
    deaths: list[bool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    join = in_flight(f"{fragile.base_url}/completions")
    fragile.wait_until(lambda: fragile.metric("quire_num_requests_running") == 6, "all running")

    def broken(*_: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    monkeypatch.setattr(holder.engine.runner, "execute", broken)
    assert_everyone_answered(join(), "engine_down")
    fragile.wait_until(lambda: bool(deaths), "death reported")
    assert error_of(httpx2.get(f"{fragile.url}/health"), 503)["type"] == "server_error"
    response = httpx2.post(f"{fragile.base_url}/completions", json={"prompt": "a"})
    assert error_of(response, 503)["code"] == "engine_down"
    assert "retry-after" in response.headers


@pytest.mark.parametrize("fragile", [1.0], ids=["step-timeout-1s"], indirect=True)
def test_a_hanging_step_turns_health_503_and_answers_everyone(
    fragile: RunningServer,
    holder: EngineHolder,
    deaths: list[bool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert httpx2.get(f"{fragile.url}/health").status_code == 200
    release = threading.Event()
    real = holder.engine.runner.execute

    def hanging(out: Any) -> Any:
        release.wait(timeout=60)  # a wedged kernel, until the test lets it go
        return real(out)

    join = in_flight(f"{fragile.base_url}/completions")
    fragile.wait_until(lambda: fragile.metric("quire_num_requests_running") == 6, "all running")
    monkeypatch.setattr(holder.engine.runner, "execute", hanging)
    try:
        # step_timeout is 1 s: the watchdog gives up on the engine and answers everyone.
        assert_everyone_answered(join(), "engine_hung")
        error = error_of(httpx2.get(f"{fragile.url}/health"), 503)
        assert error["message"] == "the engine loop is not running"
        assert deaths == [True]
        response = httpx2.post(f"{fragile.base_url}/completions", json={"prompt": "a"})
        assert error_of(response, 503)["code"] == "engine_hung"
    finally:
        release.set()  # the step returns, the thread sees it was given up on and frees all


def test_an_unhandled_exception_answers_in_openai_shape(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(server_job, "usage", broken)
    body = {"prompt": "abc", "max_tokens": 2}
    error = error_of(httpx2.post(f"{server.base_url}/completions", json=body), 500)
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx2.stream("POST", f"{server.base_url}/completions", json=stream) as response:
        events = sse_payloads(response.iter_lines())
    assert events[-2]["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
    monkeypatch.undo()
    server.wait_until_idle()
    still_serving(server)


def test_tokenization_and_chat_templates_run_off_the_event_loop(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real = prompt_encoder.PromptEncoder._encode

    def recording(self: Any, text: str, add_special_tokens: bool) -> list[int]:
        threads.append(threading.current_thread().name)
        return real(self, text, add_special_tokens)

    monkeypatch.setattr(prompt_encoder.PromptEncoder, "_encode", recording)
    big = "word " * 100_000  # 500 kB: tokenized on the worker, then refused as too long
    response = httpx2.post(f"{server.base_url}/completions", json={"prompt": big}, timeout=60)
    assert error_of(response, 400)["code"] == "context_length_exceeded"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx2.post(f"{server.base_url}/chat/completions", json=chat).status_code == 200
    assert len(threads) == 2 and all(name.startswith("quire-tokenize") for name in threads)
