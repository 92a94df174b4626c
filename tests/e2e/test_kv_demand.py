"""Scaling ahead of the pool running dry: the KV-demand gauge against KV usage on one burst.

Seven clients arrive at once at a replica with 256 blocks of 16 tokens (4,096 tokens); each keeps
one request in flight: 16 prompt tokens, exactly 960 generated (``ignore_eos``). The same load runs
twice, once scaling on KV demand >= 0.8, once on KV usage >= 0.8:

- demand = known tokens + half the remaining max_tokens = 16 + 480 -> 31 blocks per request, 217
  of 256 blocks (0.85) the moment the requests are admitted;
- usage starts at 1 block per request (0.03), reaches 0.8 only after ~450 generated tokens each,
  and the pool overflows (the first preemption) after ~580: the whole growth phase (several
  seconds even at 70 tokens/s per request) lies between demand's decision and usage's.

Asserted (structural on this load): the demand run decides while Prometheus has recorded no
preemption, and sooner after the load started than the usage run. The usage run's decision is
logged against its first preemption: both come near the end of the growth phase, so which of them
is first is a race between the chain's latency and the engine's speed, reported, not asserted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.e2e.harness import STEP_TIMEOUT_S, Scenario

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CLIENTS = 7
TARGET = 0.8
ENGINE = {"max_num_seqs": 16, "num_blocks": 256, "max_model_len": 1024}


def burst_until_scaled(s: Scenario) -> tuple[float, float, float | None]:
    """Start the burst and wait for the HPA to want 2 replicas; returns (seconds from load start
    to the decision, preemptions recorded by then, seconds to the first preemption or None)."""
    s.start_load(concurrency=CLIENTS, prompt_len=16, max_tokens=960, max_requests=3 * CLIENTS)
    started = time.monotonic()
    first_preemption = None
    deadline = started + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        preempted = s.preemptions()
        if first_preemption is None and preempted > 0:
            first_preemption = time.monotonic() - started
            s.timeline.mark("first preemption")
        if s.desired_replicas() >= 2:
            decided = time.monotonic() - started
            usage = s.per_pod("quire_kv_cache_usage_ratio")
            demand = s.per_pod("quire_kv_cache_demand_ratio")
            s.timeline.mark(
                f"scaling decision {decided:.1f}s after the burst: preemptions={preempted:g}, "
                f"usage={list(usage.values())}, demand={list(demand.values())}"
            )
            return decided, preempted, first_preemption
        time.sleep(0.5)
    raise AssertionError(f"{s.name}: no scale-out within {STEP_TIMEOUT_S:.0f}s of the burst")


def test_kv_demand_scales_before_the_first_preemption_and_before_usage(
    scenario: Callable[..., Scenario],
) -> None:
    demand = scenario("demand", "keda")
    demand.create({"targetKVCacheDemand": TARGET}, **ENGINE)
    demand_decided, demand_preempted, _ = burst_until_scaled(demand)
    demand.close()

    usage = scenario("usage", "keda")
    usage.create({"targetKVCacheUtilization": TARGET}, **ENGINE)
    usage_decided, usage_preempted, usage_first = burst_until_scaled(usage)
    usage.timeline.mark(
        f"usage run: decision at {usage_decided:.1f}s, first preemption at {usage_first}, "
        f"preemptions by the decision {usage_preempted:g}; demand run decided at "
        f"{demand_decided:.1f}s"
    )

    assert demand_preempted == 0, f"the engine preempted {demand_preempted:g} times first"
    assert demand_decided < usage_decided
