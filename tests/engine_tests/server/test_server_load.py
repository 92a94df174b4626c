"""The server under concurrency: many streams at once equal the offline engine token for token,
the metrics count exactly the traffic, a gone client frees its blocks within one step, a tiny pool
preempts (and says so), and ``--max-waiting`` sheds load with 503."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx2
import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.engine.observer import StepRecord
from tests.engine_tests.live_server import (
    EngineHolder,
    RunningServer,
    Samples,
    serve,
    tiny_settings,
)
from tests.engine_tests.ties import assert_tie_free

EVERY_METRIC = (  # docs/metrics.md
    "quire_kv_cache_usage_ratio",
    "quire_kv_blocks_capacity",
    "quire_kv_blocks_free",
    "quire_num_requests_running",
    "quire_num_requests_waiting",
    "quire_num_requests_swapped",
    "quire_preemptions_total",
    "quire_prefix_cache_queries_total",
    "quire_prefix_cache_hits_total",
    "quire_prompt_tokens_total",
    "quire_generation_tokens_total",
    "quire_request_success_total",
    "quire_time_to_first_token_seconds",
    "quire_inter_token_latency_seconds",
    "quire_e2e_request_latency_seconds",
    "quire_request_queue_time_seconds",
)


def grew(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before[key]


async def stream_all(server: RunningServer, prompts: list[str], max_tokens: int) -> list[str]:
    async def one(client: object, prompt: str) -> str:
        stream = await client.completions.create(  # type: ignore[attr-defined]
            model="tiny",
            prompt=prompt,
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async with server.async_client() as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def test_64_concurrent_streams_equal_offline_and_metrics_count_them(server: RunningServer) -> None:
    prompts = [f"request {i}: {'ab' * (i % 5)}" for i in range(64)]
    max_tokens = 6
    before = server.metrics()
    texts = asyncio.run(stream_all(server, prompts, max_tokens))

    offline = LLM(device="cpu", num_blocks=256, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    expected = offline.generate(prompts, params)
    assert_tie_free(expected)  # batched differently from the server's run: ties could flip
    assert texts == [out.outputs[0].text for out in expected]

    after = server.wait_until_idle()
    for name in EVERY_METRIC:
        assert any(key[0].startswith(name) for key in after), name
    assert after[("quire_kv_cache_usage_ratio", ())] == 0
    assert after[("quire_kv_blocks_free", ())] == after[("quire_kv_blocks_capacity", ())] == 256
    num_prompt_tokens = sum(len(p.encode()) + 1 for p in prompts)  # bytes + BOS
    assert grew(before, after, "quire_request_success_total", finished_reason="length") == 64
    assert grew(before, after, "quire_prompt_tokens_total") == num_prompt_tokens
    assert grew(before, after, "quire_generation_tokens_total") == 64 * max_tokens
    assert grew(before, after, "quire_prefix_cache_queries_total") == num_prompt_tokens
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert grew(before, after, f"quire_{histogram}_seconds_count") == 64
    # Every token after a sample's first is one inter-token gap.
    assert grew(before, after, "quire_inter_token_latency_seconds_count") == 64 * (max_tokens - 1)
    assert grew(before, after, "quire_preemptions_total", mode="recompute") == 0


class Lockstep:
    """A step observer that lets the engine sample at most ``lead`` tokens ahead of what the
    client has read (the client calls ``consumed`` per event), until ``release``: the request
    is then still running when the client looks, whatever the machine's speed."""

    def __init__(self, lead: int) -> None:
        self._credits = threading.Semaphore(lead)
        self._released = threading.Event()

    def on_step(self, step: StepRecord) -> None:
        if any(step.schedule.samples) and not self._released.is_set():
            self._credits.acquire(timeout=60)  # a stuck client fails the test, not the run

    def consumed(self) -> None:
        self._credits.release()

    def release(self) -> None:
        self._released.set()
        self._credits.release()


def test_a_client_that_disconnects_is_aborted_within_one_step() -> None:
    holder = EngineHolder()
    with serve(tiny_settings(engine_factory=holder)) as server:
        before = server.metrics()
        lockstep = Lockstep(lead=2)
        holder.engine.add_observer(lockstep)
        body = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            with httpx2.stream("POST", f"{server.base_url}/completions", json=body) as response:
                events = 0
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events += 1
                    if events == 2:
                        # Chunks arrive while the request still runs (streamed, not buffered).
                        assert server.metric("quire_num_requests_running") == 1
                        break  # closing the line iterator closes the connection mid-stream
                    lockstep.consumed()
        finally:
            lockstep.release()
        after = server.wait_until_idle()
        assert grew(before, after, "quire_request_success_total", finished_reason="abort") == 1
        assert grew(before, after, "quire_generation_tokens_total") < 200
        assert server.engine.max_abort_lag_steps <= 1
        holder.engine.remove_observer(lockstep)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_and_still_matches_offline(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    # 8 blocks of 16 tokens; four requests that each grow to 46 tokens (3 blocks) cannot all run.
    settings = tiny_settings(
        {
            "num_blocks": 8,
            "max_model_len": 128,
            "preemption_mode": mode,
            "swap_space": 0.002,  # 2 MiB: 32 CPU blocks of the tiny model
        }
    )
    prompts = [f"{i}: preempt me" for i in range(4)]
    with serve(settings) as tiny, caplog.at_level(logging.WARNING, "quire_engine.engine.recorder"):
        texts = asyncio.run(stream_all(tiny, prompts, 32))
        after = tiny.wait_until_idle()
    assert after[("quire_preemptions_total", (("mode", mode),))] > 0
    assert any("preempted" in r.getMessage() for r in caplog.records)
    offline = LLM(device="cpu", num_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    expected = offline.generate(prompts, params)
    assert_tie_free(expected)
    assert texts == [out.outputs[0].text for out in expected]


def test_max_waiting_sheds_load_with_503_and_retry_after() -> None:
    settings = tiny_settings({"max_num_seqs": 1}, max_waiting=1)
    long = {"prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serve(settings) as srv, httpx2.Client(base_url=srv.base_url) as client:
        with client.stream("POST", "/completions", json=long) as running:
            lines = running.iter_lines()  # kept referenced: closing it would disconnect
            assert next(lines).startswith("data: ")
            with (
                httpx2.Client(base_url=srv.base_url) as second,
                second.stream("POST", "/completions", json=long) as queued,
            ):
                assert queued.status_code == 200  # admitted: one may wait
                shed = httpx2.post(f"{srv.base_url}/completions", json=long)
                assert shed.status_code == 503
                assert shed.headers["retry-after"] == "1"
                assert shed.json()["error"]["code"] == "overloaded"
            # The queued client left before it ever ran: aborted from the waiting queue.
        after = srv.wait_until_idle()
        assert after[("quire_request_success_total", (("finished_reason", "abort"),))] == 2
        ok = client.post("/completions", json={"prompt": "abc", "max_tokens": 2})
        assert ok.status_code == 200
