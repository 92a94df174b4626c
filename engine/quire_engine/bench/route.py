"""Routed fleet benchmark: the same shared-prefix workload through a routing gateway (an
InferencePool behind its Endpoint Picker) and through the plain Service, in one run.

The fleet is N engine replicas reachable three ways: ``--pool-url`` (the gateway that asks the
Endpoint Picker where each request goes), ``--service-url`` (the plain Kubernetes Service, which
spreads requests without looking at the engines) and each replica directly (``--engine-url``,
once per replica: its ``/metrics`` is read before and after each phase, and the low-load probes
use it as the no-gateway baseline).

The workload is what prefix-aware routing is for: ``--groups`` long system prompts, each shared
by ``--requests-per-group`` requests that differ only in a short user suffix, sent interleaved
across groups at ``--max-concurrency``. Each phase draws its own prompts (a different seed), so
the second phase finds nothing the first one cached. Prompts are printable ASCII text: routers
hash prompt text, and the embedded byte tokenizer makes one token per character.

Per phase (``service``, then ``pool``): client-side TTFT and e2e percentiles, output throughput,
failures, and from the engines' counters the fleet's prefix-cache hit rate (prompt tokens found
in the cache / prompt tokens looked up) and how many requests each replica finished. Then, at low
load (one request at a time, ``--latency-probes`` rounds), the e2e latency of a one-token
completion directly, through the Service and through the pool: the differences are what each
path adds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx2

from quire_engine.bench.client import (
    RequestResult,
    latency_summary,
    model_card,
    percentile,
    scrape,
    stream_completion,
)
from quire_engine.bench.workload import RequestLengths

# Counters read from each engine before and after a phase (sums over their label sets).
PREFIX_QUERIES = "quire_prefix_cache_queries_total"
PREFIX_HITS = "quire_prefix_cache_hits_total"
FINISHED = "quire_request_success_total"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool-url", required=True, help="gateway routing through the pool")
    parser.add_argument("--service-url", required=True, help="the plain Service")
    parser.add_argument(
        "--engine-url",
        action="append",
        required=True,
        help="one replica's base URL (repeat for each): metrics and the direct baseline",
    )
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--groups", type=int, default=6, help="distinct shared system prompts")
    parser.add_argument("--requests-per-group", type=int, default=8)
    parser.add_argument("--system-prompt-len", type=int, default=768, help="characters")
    parser.add_argument("--user-prompt-len", type=int, default=24, help="characters")
    parser.add_argument("--output-len", type=int, default=16, help="tokens per request")
    parser.add_argument("--max-concurrency", type=int, default=6, help="requests in flight")
    parser.add_argument("--latency-probes", type=int, default=20, help="low-load rounds")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)


class Counters(NamedTuple):
    """One engine's cumulative counters at one scrape."""

    prefix_queries: float
    prefix_hits: float
    finished: float


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    """``groups`` system prompts x ``per_group`` user suffixes, in send order (interleaved)."""

    prompts: tuple[str, ...]
    output_len: int

    @classmethod
    def draw(cls, args: argparse.Namespace, seed: int) -> SharedPrefixWorkload:
        rng = random.Random(seed)

        def text(n: int) -> str:
            return "".join(chr(rng.randrange(32, 127)) for _ in range(n))

        systems = [text(args.system_prompt_len) for _ in range(args.groups)]
        prompts = [
            f"{system}\n{text(args.user_prompt_len)}"
            for system in systems
            for _ in range(args.requests_per_group)
        ]
        # Round-robin over groups, then a seeded shuffle within each round: a group's requests
        # are spread over the whole phase, as a fleet's traffic is.
        rounds = [prompts[g :: args.requests_per_group] for g in range(args.requests_per_group)]
        ordered: list[str] = []
        for batch in rounds:
            rng.shuffle(batch)
            ordered += batch
        return cls(tuple(ordered), args.output_len)


def run(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("groups", "requests_per_group", "max_concurrency", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1; got {getattr(args, name)}")
    if args.system_prompt_len < 1 or args.user_prompt_len < 1 or args.latency_probes < 0:
        raise ValueError("prompt lengths must be >= 1 and latency_probes >= 0")
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    timeout = httpx2.Timeout(args.timeout, connect=10.0)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)

    def client(url: str) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(base_url=url.rstrip("/"), timeout=timeout, limits=limits)

    engines = [client(url) for url in args.engine_url]
    pool, service = client(args.pool_url), client(args.service_url)
    try:
        model, _ = await model_card(engines[0], args.model)
        for engine in engines:  # first-request costs on every replica, outside the phases
            await _one_token(engine, model, f"warm-up {random.random()}")
        result: dict[str, Any] = {
            "model": model,
            "replicas": len(engines),
            "workload": {
                "groups": args.groups,
                "requests_per_group": args.requests_per_group,
                "system_prompt_chars": args.system_prompt_len,
                "user_prompt_chars": args.user_prompt_len,
                "output_tokens": args.output_len,
                "max_concurrency": args.max_concurrency,
            },
        }
        for phase, (target, seed) in {
            "service": (service, args.seed * 2 + 1),
            "pool": (pool, args.seed * 2 + 2),
        }.items():
            workload = SharedPrefixWorkload.draw(args, seed)
            result[phase] = await _phase(target, engines, model, workload, args.max_concurrency)
        result["ratios"] = _ratios(result["pool"], result["service"])
        result["low_load_latency"] = await _probes(
            engines, service, pool, model, args.latency_probes
        )
        return result
    finally:
        for c in (*engines, pool, service):
            await c.aclose()


async def _phase(
    target: httpx2.AsyncClient,
    engines: list[httpx2.AsyncClient],
    model: str,
    workload: SharedPrefixWorkload,
    concurrency: int,
) -> dict[str, Any]:
    before = [await _counters(e) for e in engines]
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    results: list[RequestResult] = await asyncio.gather(
        *(
            stream_completion(
                target, model, prompt, RequestLengths(len(prompt), workload.output_len), gate
            )
            for prompt in workload.prompts
        )
    )
    duration = time.perf_counter() - start
    after = [await _counters(e) for e in engines]
    queries = sum(a.prefix_queries - b.prefix_queries for a, b in zip(after, before, strict=True))
    hits = sum(a.prefix_hits - b.prefix_hits for a, b in zip(after, before, strict=True))
    done = [r for r in results if r.error is None]
    report: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration, 3),
        "output_throughput": round(sum(r.output_tokens for r in done) / duration, 2),
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "requests_per_replica": [
            int(a.finished - b.finished) for a, b in zip(after, before, strict=True)
        ],
    }
    report.update(latency_summary("ttft", [r.ttft for r in done if r.ttft is not None]))
    report.update(latency_summary("e2e", [r.e2e for r in done if r.e2e is not None]))
    report["errors"] = sorted({r.error for r in results if r.error is not None})[:5]
    return report


def _ratios(pool: dict[str, Any], service: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        a, b = pool.get(key), service.get(key)
        return round(a / b, 3) if a is not None and b else None

    return {
        "prefix_hit_rate_pool_over_service": ratio("prefix_hit_rate"),
        "ttft_p50_pool_over_service": ratio("p50_ttft_ms"),
        "ttft_p99_pool_over_service": ratio("p99_ttft_ms"),
        "throughput_pool_over_service": ratio("output_throughput"),
    }


async def _probes(
    engines: list[httpx2.AsyncClient],
    service: httpx2.AsyncClient,
    pool: httpx2.AsyncClient,
    model: str,
    rounds: int,
) -> dict[str, Any]:
    """One-token completions one at a time, the three paths in a rotating order per round."""
    seconds: dict[str, list[float]] = {"direct": [], "service": [], "pool": []}
    failed = 0
    for i in range(rounds):
        paths = [("direct", engines[i % len(engines)]), ("service", service), ("pool", pool)]
        for name, target in paths[i % 3 :] + paths[: i % 3]:
            elapsed = await _one_token(target, model, f"probe {i} {name} {random.random()}")
            if elapsed is None:
                failed += 1
            else:
                seconds[name].append(elapsed)
    p50 = {k: round(percentile(v, 50) * 1000, 2) if v else None for k, v in seconds.items()}
    direct = p50["direct"]
    return {
        "rounds": rounds,
        "failed": failed,
        "p50_ms": p50,
        "added_p50_ms": {
            path: round(value - direct, 2) if value is not None and direct is not None else None
            for path, value in p50.items()
            if path != "direct"
        },
    }


async def _one_token(client: httpx2.AsyncClient, model: str, prompt: str) -> float | None:
    """Seconds for a non-streamed one-token completion; None when it failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    try:
        response = await client.post("/v1/completions", json=body)
    except httpx2.HTTPError:
        return None
    return time.perf_counter() - start if response.status_code == 200 else None


async def _counters(engine: httpx2.AsyncClient) -> Counters:
    totals = {PREFIX_QUERIES: 0.0, PREFIX_HITS: 0.0, FINISHED: 0.0}
    for family in await scrape(engine):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return Counters(totals[PREFIX_QUERIES], totals[PREFIX_HITS], totals[FINISHED])
