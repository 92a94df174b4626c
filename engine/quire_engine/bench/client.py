"""The benchmarks' HTTP client side: one streamed completion measured as a client sees it, the
server's model card and ``/metrics``, and latency summaries.

Shared by ``bench serve`` (one server) and ``bench route`` (a fleet behind a gateway). Timing is
the client's: TTFT is send -> first streamed chunk with a choice, ITL the gaps between such
chunks, e2e send -> end of stream. A request fails on a non-200 status, an error event, a
transport error or a missing usage chunk; the failure is recorded, never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx2

from quire_engine.bench.workload import RequestLengths

if TYPE_CHECKING:
    from prometheus_client.core import Metric


@dataclass(slots=True)
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


async def scrape(client: httpx2.AsyncClient) -> list[Metric]:
    """The server's ``/metrics``, parsed; empty when it has none (not a Quire server)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get("/metrics")
    if response.status_code != 200:
        return []
    return list(text_string_to_metric_families(response.text))


async def model_card(client: httpx2.AsyncClient, model: str | None) -> tuple[str, int]:
    response = await client.get("/v1/models")
    response.raise_for_status()
    cards = response.json()["data"]
    card = next((c for c in cards if c["id"] == model), cards[0] if cards else {})
    if not card and model is None:
        raise ValueError("the server lists no model; pass --model")
    # max_model_len is a vLLM/Quire extension of the model card; 2048 when a server lacks it.
    return model or card["id"], int(card.get("max_model_len") or 2048)


async def stream_completion(
    client: httpx2.AsyncClient,
    model: str,
    prompt: list[int] | str,
    length: RequestLengths,
    gate: asyncio.Semaphore | None,
    ignore_eos: bool = True,
) -> RequestResult:
    result = RequestResult(prompt_tokens=length.prompt)
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": length.output,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # a vLLM/Quire extension; servers that lack it may refuse the field
        body["ignore_eos"] = True
    async with gate or contextlib.nullcontext():
        sent = last = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:200]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.error = str(event["error"].get("message"))
                        return result
                    now = time.perf_counter()
                    if event.get("usage"):
                        result.prompt_tokens = event["usage"]["prompt_tokens"]
                        result.output_tokens = event["usage"]["completion_tokens"]
                    if not event.get("choices"):
                        continue
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.itls.append(now - last)
                    last = now
        except httpx2.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.e2e = time.perf_counter() - sent
    if result.ttft is None or not result.output_tokens:
        result.error = "the stream ended without tokens or usage"
    return result


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_summary(name: str, seconds: list[float]) -> dict[str, float | None]:
    ms = [s * 1000 for s in seconds]
    if not ms:
        return {f"mean_{name}_ms": None, f"p50_{name}_ms": None, f"p99_{name}_ms": None}
    return {
        f"mean_{name}_ms": round(sum(ms) / len(ms), 2),
        f"p50_{name}_ms": round(percentile(ms, 50), 2),
        f"p99_{name}_ms": round(percentile(ms, 99), 2),
    }
