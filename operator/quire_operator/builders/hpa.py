"""Pure builder: InferenceService -> its HorizontalPodAutoscaler (backend ``hpa``).

Ownership (server-side apply, field manager ``quire-operator``): the operator owns every field of
the HPA and the HPA controller owns the scale target's ``spec.replicas``. The HPA exists only
while autoscaling is on with backend ``hpa`` (``None`` otherwise); the reconciler then deletes
the one it owns, since an apply cannot express "absent".
"""

from __future__ import annotations

from typing import Any

from quire_operator import meta
from quire_operator.builders.leader_worker_set import scale_target
from quire_operator.spec.view import InferenceService

# Pods metrics the HPA reads through the custom metrics API. The first three are engine gauges as
# exported; the fourth is the name the chart's prometheus-adapter rule gives to
# rate(quire_preemptions_total[1m]) per pod.
KV_CACHE_METRIC = "quire_kv_cache_usage_ratio"
KV_DEMAND_METRIC = "quire_kv_cache_demand_ratio"
QUEUE_METRIC = "quire_num_requests_waiting"
PREEMPTION_METRIC = "quire_preemptions_per_second"


def quantity(value: float) -> str:
    """A Kubernetes quantity in the API server's canonical form: 4 -> "4", 0.8 -> "800m",
    0.0005 -> "500u", so an unchanged spec re-applies as an exact no-op."""
    micro = round(value * 1_000_000)
    if micro % 1_000_000 == 0:
        return str(micro // 1_000_000)
    if micro % 1_000 == 0:
        return f"{micro // 1_000}m"
    return f"{micro}u"


def _pods_metric(name: str, average: float) -> dict[str, Any]:
    target = {"type": "AverageValue", "averageValue": quantity(average)}
    return {"type": "Pods", "pods": {"metric": {"name": name}, "target": target}}


def build_hpa(isvc: InferenceService) -> dict[str, Any] | None:
    """autoscaling/v2 HPA on the engine's Pods metrics, only those with a target; None when
    autoscaling is off."""
    autoscaling = isvc.autoscaling
    if not autoscaling.enabled:
        return None
    targets = [
        (KV_CACHE_METRIC, autoscaling.target_kv_cache_utilization),
        (KV_DEMAND_METRIC, autoscaling.target_kv_cache_demand),
        (QUEUE_METRIC, autoscaling.target_queue_depth),
        (PREEMPTION_METRIC, autoscaling.target_preemption_rate),
    ]
    spec: dict[str, Any] = {
        "scaleTargetRef": scale_target(isvc),
        "minReplicas": autoscaling.min_replicas,
        "maxReplicas": autoscaling.max_replicas,
        "metrics": [_pods_metric(name, target) for name, target in targets if target is not None],
    }
    if autoscaling.behavior:
        spec["behavior"] = dict(autoscaling.behavior)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta.object_meta(isvc.ref),
        "spec": spec,
    }
