"""The autoscaling backends as pure builders: exactly one of HPA and ScaledObject, with the same
targets; no cluster (specs are defaulted from the CRD file as the API server would)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from quire_operator.builders.autoscaling import (
    build_autoscalers,
    build_scaled_object,
    pod_matchers,
    trigger_queries,
)
from quire_operator.builders.hpa import build_hpa
from quire_operator.config import OperatorConfig
from quire_operator.spec.parsing import parse
from quire_operator.spec.view import AutoscalingBackend, InferenceService
from tests.operator_tests.helpers import inference_service, load_example

UID = "0b5c8a5e-1111-4222-8333-944455556666"
PROMETHEUS = "http://prometheus.monitoring:9090"
CONFIG = OperatorConfig(prometheus_address=PROMETHEUS)
SEL = 'namespace="ml",pod=~"tiny-[a-z0-9]+-[a-z0-9]+"'
KV_USE = "quire_kv_cache_usage_ratio"


def isvc(**autoscaling: Any) -> InferenceService:
    spec = load_example()["spec"]
    merged = {**spec["autoscaling"], **autoscaling}
    return parse(inference_service({**spec, "autoscaling": merged}, name="tiny", uid=UID))


def keda(**autoscaling: Any) -> InferenceService:
    return isvc(backend="keda", **autoscaling)


def test_default_backend_is_hpa() -> None:
    service = isvc()
    assert service.autoscaling.backend is AutoscalingBackend.HPA
    kinds = [(kind, obj is not None) for kind, obj in build_autoscalers(service, CONFIG)]
    assert kinds == [("HorizontalPodAutoscaler", True), ("ScaledObject", False)]
    # Without a Prometheus address: the hpa backend needs none.
    assert build_autoscalers(service, OperatorConfig())[0][1] == build_hpa(service)


def test_keda_backend_has_a_scaled_object_and_no_hpa() -> None:
    kinds = [(kind, obj is not None) for kind, obj in build_autoscalers(keda(), CONFIG)]
    assert kinds == [("HorizontalPodAutoscaler", False), ("ScaledObject", True)]


def test_autoscaling_off_builds_neither() -> None:
    for backend in ("hpa", "keda"):
        built = build_autoscalers(isvc(enabled=False, backend=backend), CONFIG)
        assert [obj for _, obj in built] == [None, None]


def test_example_scaled_object_is_exactly_this() -> None:
    scaled = build_scaled_object(keda(), CONFIG)
    assert scaled is not None
    hpa = build_hpa(isvc())
    assert hpa is not None
    assert scaled == {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": hpa["metadata"],  # same name, labels and owner reference as the HPA's
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny"},
            "minReplicaCount": 1,
            "maxReplicaCount": 4,
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "advanced": {
                "restoreToOriginalReplicaCount": False,
                # The CRD's default behavior, the same the HPA backend gets.
                "horizontalPodAutoscalerConfig": {"behavior": hpa["spec"]["behavior"]},
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "name": "kv-cache-usage",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": PROMETHEUS,
                        "query": f"sum(max by (namespace, pod) ({KV_USE}{{{SEL}}}))",
                        "threshold": "0.8",
                    },
                },
                {
                    "type": "prometheus",
                    "name": "queue-depth",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": PROMETHEUS,
                        "query": f"sum(quire_num_requests_waiting{{{SEL}}})",
                        "threshold": "8",
                    },
                },
            ],
        },
    }


def test_every_target_becomes_one_trigger_in_a_fixed_order() -> None:
    service = keda(
        targetKVCacheUtilization=0.9,
        targetKVCacheDemand=1.25,
        targetQueueDepth=3,
        targetPreemptionRate=0.5,
    )
    assert trigger_queries(service) == [
        (
            "kv-cache-usage",
            f"sum(max by (namespace, pod) (quire_kv_cache_usage_ratio{{{SEL}}}))",
            0.9,
        ),
        (
            "kv-cache-demand",
            f"sum(max by (namespace, pod) (quire_kv_cache_demand_ratio{{{SEL}}}))",
            1.25,
        ),
        ("queue-depth", f"sum(quire_num_requests_waiting{{{SEL}}})", 3.0),
        ("preemption-rate", f"sum(rate(quire_preemptions_total{{{SEL}}}[1m]))", 0.5),
    ]
    scaled = build_scaled_object(service, CONFIG)
    assert scaled is not None
    thresholds = [t["metadata"]["threshold"] for t in scaled["spec"]["triggers"]]
    assert thresholds == ["0.9", "1.25", "3", "0.5"]


def test_kv_demand_is_an_hpa_pods_metric_too() -> None:
    hpa = build_hpa(
        isvc(targetKVCacheUtilization=None, targetQueueDepth=None, targetKVCacheDemand=0.9)
    )
    assert hpa is not None
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "quire_kv_cache_demand_ratio"},
                "target": {"type": "AverageValue", "averageValue": "900m"},
            },
        }
    ]


def test_spec_address_fallback_and_timing_override_the_defaults() -> None:
    service = keda(
        keda={
            "serverAddress": "http://127.0.0.1:9090",
            "pollingInterval": 2,
            "cooldownPeriod": 30,
            "fallback": {"failureThreshold": 3, "replicas": 2},
        }
    )
    scaled = build_scaled_object(service, OperatorConfig())
    assert scaled is not None
    spec = scaled["spec"]
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (2, 30)
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 2}
    addresses = {t["metadata"]["serverAddress"] for t in spec["triggers"]}
    assert addresses == {"http://127.0.0.1:9090"}


def test_keda_without_a_prometheus_address_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"keda needs a Prometheus address.*serverAddress"):
        build_scaled_object(keda(), OperatorConfig())


def test_pod_matcher_keeps_out_a_longer_named_sibling() -> None:
    # PromQL's =~ is fully anchored, like re.fullmatch.
    found = re.search(r'pod=~"([^"]+)"', pod_matchers(isvc()))
    assert found is not None
    pattern = re.compile(found.group(1))
    assert pattern.fullmatch("tiny-5d8f7c9b4-x2k9q")
    assert not pattern.fullmatch("tiny-big-5d8f7c9b4-x2k9q")
    assert not pattern.fullmatch("tinyx-5d8f7c9b4-x2k9q")


def test_demand_counts_as_the_one_target() -> None:
    only_demand = isvc(targetKVCacheUtilization=None, targetQueueDepth=None, targetKVCacheDemand=1)
    assert only_demand.autoscaling.target_kv_cache_demand == 1.0
    with pytest.raises(ValueError, match="at least one target"):
        isvc(targetKVCacheUtilization=None, targetQueueDepth=None)
