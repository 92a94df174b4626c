"""HPA + prometheus-adapter end to end (backend hpa, the default): the chart's adapter rules as
``helm template`` renders them serve the engines' Prometheus series as Pods custom metrics, and
the operator's own HPA scales the Deployment out on queue depth and back in.

The three signals each scale alone on the KEDA path (test_autoscaling_keda.py); here queue depth
and scale-in prove the adapter wiring, to keep the suite within its CI budget.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.quantity import parse_quantity
from tests.e2e.scaling_scenario import Scenario, poll

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def pods_metric(scenario: Scenario, metric: str) -> dict[str, float]:
    return {
        item["describedObject"]["name"]: parse_quantity(item["value"])
        for item in scenario.metrics_api(metric)
    }


def test_queue_depth_scales_out_then_in_through_the_adapter(
    scenario: Callable[..., Scenario],
) -> None:
    s = scenario("queue", "hpa")
    s.create({"targetQueueDepth": 2}, max_num_seqs=2, num_blocks=256)
    s.start_load(concurrency=8, prompt_len=16, max_tokens=48)

    poll(
        "queue depth in the custom metrics API",
        lambda: pods_metric(s, "quire_num_requests_waiting"),
        lambda per_pod: any(v >= 3 for v in per_pod.values()),
        120,
    )
    s.timeline.mark("metric visible: custom.metrics.k8s.io quire_num_requests_waiting >= 3")
    # Every rule of the chart is served, not only the one this HPA reads.
    for metric in (
        "quire_kv_cache_usage_ratio",
        "quire_kv_cache_demand_ratio",
        "quire_preemptions_per_second",
    ):
        assert pods_metric(s, metric), f"{metric} missing from custom.metrics.k8s.io"
    poll("HPA ScalingActive", s.scaling_active, bool, 60)
    s.timeline.mark("HPA ScalingActive=True")
    peak = s.queue_peak()

    s.expect_scale_out()
    s.expect_queue_to_fall(peak)

    s.expect_scale_in_without_operator_replicas()
