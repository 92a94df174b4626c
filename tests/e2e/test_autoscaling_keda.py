"""KEDA end to end: engines -> Prometheus -> KEDA (ScaledObject the operator wrote) -> HPA
controller -> Deployment -> pod runner, on each of the three signals, and back to minReplicas.

Every scenario runs the tiny model on CPU with small limits so pressure is reachable with a few
clients; docs/autoscaling.md shows the timelines these tests log.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.quantity import parse_quantity
from tests.e2e.scaling_scenario import Scenario, poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def first_metric(scenario: Scenario) -> float:
    items = scenario.metrics_api("s0-prometheus")
    return parse_quantity(items[0]["value"]) if items else -1.0


def test_queue_depth_scales_out_then_in_without_the_operator_touching_replicas(
    scenario: Callable[..., Scenario],
) -> None:
    s = scenario("queue", "keda")
    # 2 running slots per engine, 8 clients: one engine queues ~6; the target is 2 per pod.
    s.create({"targetQueueDepth": 2}, max_num_seqs=2, num_blocks=256)
    s.start_load(concurrency=8, prompt_len=16, max_tokens=48)

    poll("queue depth in the external metrics API", lambda: first_metric(s), lambda v: v >= 3, 120)
    s.timeline.mark("metric visible: external.metrics.k8s.io s0-prometheus >= 3")
    poll("HPA ScalingActive", s.scaling_active, bool, 60)
    s.timeline.mark("HPA ScalingActive=True")
    peak = s.queue_peak()

    s.expect_scale_out()
    # The second engine takes half the clients: the per-pod queue falls.
    s.expect_queue_to_fall(peak)

    # A spec edit while scaled out: the operator re-applies everything, replicas stay.
    before = s.deployment_replicas()
    patch = {"spec": {"autoscaling": {"keda": {"pollingInterval": 2}}}}
    s.cluster.custom.patch_namespaced_custom_object(
        "quire.dev", "v1alpha1", s.namespace, "inferenceservices", s.name, patch
    )
    poll(
        "the operator to apply generation 2",
        lambda: s.inference_service().get("status", {}).get("observedGeneration"),
        lambda generation: generation == 2,
        60,
    )
    assert s.deployment_replicas() >= before >= 2
    s.timeline.mark("spec edited while scaled out; replicas kept")

    s.expect_scale_in_without_operator_replicas()


def test_kv_cache_usage_alone_scales_out(scenario: Callable[..., Scenario]) -> None:
    s = scenario("kv", "keda")
    # 24 blocks of 16 tokens; each request grows to 32 + 96 tokens = 8 blocks: 4 clients want
    # 32 blocks, so the pool runs full. No queue target: only KV usage can scale.
    s.create({"targetKVCacheUtilization": 0.5}, max_num_seqs=8, num_blocks=24)
    s.start_load(concurrency=4, prompt_len=32, max_tokens=96)
    poll("KV usage in the metrics API", lambda: first_metric(s), lambda v: v > 0.5, 120)
    s.timeline.mark("metric visible: KV usage > 0.5")
    s.expect_scale_out()


def test_preemptions_alone_scale_out(scenario: Callable[..., Scenario]) -> None:
    s = scenario("preempt", "keda")
    # 16 blocks; 4 clients each growing to 8 blocks: the engine preempts every few steps.
    s.create({"targetPreemptionRate": 0.05}, max_num_seqs=8, num_blocks=16)
    s.start_load(concurrency=4, prompt_len=32, max_tokens=96)
    poll("preemptions in Prometheus", s.preemptions, lambda n: n > 0, 120)
    s.timeline.mark("first preemption seen by Prometheus")
    s.expect_scale_out()
