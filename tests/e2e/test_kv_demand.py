"""Scaling ahead of the pool running dry: the KV-demand gauge against KV usage on one burst.

Seven clients arrive at once at a replica with 512 blocks of 16 tokens (8,192 tokens); each keeps
one request in flight until the scaling decision: 16 prompt tokens, exactly 1,920 generated
(``ignore_eos``). The same load runs twice, once scaling on KV demand >= 0.8, once on KV usage
>= 0.8:

- demand = known tokens + half the remaining max_tokens = 16 + 960 -> 61 blocks per request, 427
  of 512 blocks (0.83) the moment the requests are admitted;
- usage starts at 1 block per request (0.01), reaches 0.8 only after ~920 generated tokens each,
  and the pool overflows (the first preemption) after ~1,150.

Asserted, on Prometheus' own record of each run (every scrape of the engine's gauges, which is
what KEDA's queries read): in the demand run the demand gauge reached the target at an earlier
scrape than the usage gauge did and than the first preemption was recorded, i.e. the autoscaler's
input said "scale" while the pool still had room; and both runs scale out. The order is the
engine's (demand is >= 0.8 from admission on, usage and preemptions need hundreds of generated
tokens), so it holds whenever the growth phase spans more than one scrape interval (250 ms here).
With 256 blocks and 960 tokens the growth phase took ~11 s on one machine, ~3.6 s on a faster one
and less than one 1-s scrape interval on a Zen 5 core, where demand and usage crossed at the same
scrape; the load then was 21 requests, and the usage run's burst ended before its autoscaler's
chain (scrape, KEDA's poll, the HPA's sync) decided: the load now runs until the decision.

Reported, not asserted: each run's decision time and its first preemption. Whether the decision
itself precedes the first preemption is a race between the chain's latency (scrape, KEDA's poll,
the HPA's sync: ~4 s here) and the engine's speed (the growth phase took ~11 s on one machine and
~3.6 s on a faster one, where the demand run decided 0.7 s after its first preemption).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypedDict

import pytest

from tests.e2e.scaling_scenario import STEP_TIMEOUT_S, Scenario
from tests.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLIENTS = 7
TARGET = 0.8
MAX_TOKENS = 1920


class EngineSize(TypedDict):
    """The engine keywords of ``Scenario.create`` that both runs share."""

    max_num_seqs: int
    num_blocks: int
    max_model_len: int


ENGINE: EngineSize = {"max_num_seqs": 16, "num_blocks": 512, "max_model_len": 2048}


def burst_until_scaled(s: Scenario) -> tuple[float, float, float | None]:
    """Start the burst and wait for the HPA to want 2 replicas; returns (seconds from load start
    to the decision, preemptions recorded by then, seconds to the first preemption or None)."""
    # Requests keep coming until the decision (Load's own bound is far beyond it): a burst that
    # ends first leaves nothing for the autoscaler to see.
    s.start_load(concurrency=CLIENTS, prompt_len=16, max_tokens=MAX_TOKENS)
    started = time.monotonic()
    first_preemption = None

    def decided() -> tuple[float, float] | None:
        """(seconds to the decision, preemptions by then) once the HPA wants 2 replicas; notes
        the first preemption on the way."""
        nonlocal first_preemption
        preempted = s.preemptions()
        if first_preemption is None and preempted > 0:
            first_preemption = time.monotonic() - started
            s.timeline.mark("first preemption")
        if s.desired_replicas() < 2:
            return None
        return time.monotonic() - started, preempted

    decided_s, preempted = wait_until(
        decided,
        timeout=STEP_TIMEOUT_S,
        interval=0.5,
        message=f"{s.name}: no scale-out within {STEP_TIMEOUT_S:.0f}s of the burst",
    )
    usage = s.per_pod("quire_kv_cache_usage_ratio")
    demand = s.per_pod("quire_kv_cache_demand_ratio")
    s.timeline.mark(
        f"scaling decision {decided_s:.1f}s after the burst: preemptions={preempted:g}, "
        f"usage={list(usage.values())}, demand={list(demand.values())}"
    )
    return decided_s, preempted, first_preemption


def first_scrape(s: Scenario, series: str, least: float) -> float | None:
    """Prometheus' timestamp of the first scrape of ``s``'s pods at which ``series`` was >=
    ``least`` (every raw sample of the last 10 minutes: a range selector in an instant query),
    or None if none was."""
    found = s.stack.query(f"{series}{{{s.matchers}}}[10m]")
    return min((float(t) for r in found for t, v in r["values"] if float(v) >= least), default=None)


def test_kv_demand_reaches_its_target_before_usage_and_before_the_first_preemption(
    scenario: Callable[..., Scenario],
) -> None:
    demand = scenario("demand", "keda")
    demand.create({"targetKVCacheDemand": TARGET}, **ENGINE)
    demand_decided, demand_preempted, demand_first = burst_until_scaled(demand)
    # Scrapes go on while the load runs: wait for one that records the pool past the usage target
    # (a preemption may or may not have come by then), so the record holds both crossings.
    wait_until(
        lambda: first_scrape(demand, "quire_kv_cache_usage_ratio", TARGET),
        until=lambda at: at is not None,
        timeout=STEP_TIMEOUT_S,
        interval=0.5,
        message="usage never reached the target in the demand run",
    )
    demand_at = first_scrape(demand, "quire_kv_cache_demand_ratio", TARGET)
    usage_at = first_scrape(demand, "quire_kv_cache_usage_ratio", TARGET)
    preempted_at = first_scrape(demand, "quire_preemptions_total", 1)
    demand.timeline.mark(
        f"demand run, Prometheus' record: demand >= {TARGET} at t={demand_at}, usage >= {TARGET} "
        f"at t={usage_at}, first preemption at t={preempted_at}; the decision came "
        f"{demand_decided:.1f}s after the burst, preemptions by then {demand_preempted:g} "
        f"(first seen {demand_first})"
    )
    demand.close()

    usage = scenario("usage", "keda")
    usage.create({"targetKVCacheUtilization": TARGET}, **ENGINE)
    usage_decided, usage_preempted, usage_first = burst_until_scaled(usage)
    usage.timeline.mark(
        f"usage run: decision at {usage_decided:.1f}s, first preemption at {usage_first}, "
        f"preemptions by the decision {usage_preempted:g}; demand run decided at "
        f"{demand_decided:.1f}s"
    )

    assert demand_at is not None and usage_at is not None
    assert demand_at < usage_at, f"demand reached {TARGET} at {demand_at}, usage at {usage_at}"
    assert preempted_at is None or demand_at < preempted_at, (
        f"demand reached {TARGET} at {demand_at}, the first preemption was at {preempted_at}"
    )
