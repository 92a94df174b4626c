"""Pure builders for the autoscaling backend an InferenceService asks for: an HPA or a KEDA
ScaledObject, never both.

Ownership (server-side apply, field manager ``quire-operator``):
- backend ``hpa``: the operator owns the HPA named after the InferenceService
  (``builders.hpa``) and the HPA controller owns the Deployment's ``spec.replicas``.
- backend ``keda``: the operator owns the ScaledObject named after the InferenceService; KEDA
  makes and owns an HPA named ``keda-hpa-<name>`` for it, and that HPA owns ``spec.replicas``.
  The operator never writes an HPA for a Deployment KEDA scales (two HPAs on one target make the
  HPA controller stop scaling both).
- Whichever object the spec does not call for is ``None``: the reconciler deletes it if this
  InferenceService owns it, before it applies the other, so the two never coexist.

Both backends express the same per-pod targets. The HPA reads Pods metrics (an average over the
pods, which prometheus-adapter serves per pod); a KEDA Prometheus trigger reads one number and
HPA divides it by the threshold (``AverageValue``), so each query sums the per-pod values over the
InferenceService's pods: ``sum / threshold`` equals ``average / target`` times the pod count.
"""

from __future__ import annotations

from typing import Any

from quire_operator import meta
from quire_operator.builders.hpa import build_hpa
from quire_operator.builders.leader_worker_set import scale_target
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.spec.view import AutoscalingBackend, InferenceService

# Held requests per replica the held-requests trigger aims at when targetQueueDepth is unset:
# the Endpoint Picker's utilization detector's default queueDepthThreshold (GIE v1.5.0).
HELD_PER_REPLICA = 5.0
HELD_TRIGGER = "held-requests"

# The window of rate(quire_preemptions_total[...]): the same as the chart's adapter rule default
# (adapterRules.preemptionRateWindow), so both backends see the same preemption rate.
PREEMPTION_RATE_WINDOW = "1m"


def pod_matchers(isvc: InferenceService) -> str:
    """PromQL label matchers for the InferenceService's engine pods.

    Scrapers (the chart's PodMonitor, kubernetes_sd) label each series with ``namespace`` and
    ``pod``. A Deployment's pods are named ``<name>-<replicaset hash>-<suffix>``; requiring exactly
    two dash-free segments after the name keeps out the pods of an InferenceService named
    ``<name>-<something>`` (theirs have three). A multi-node replica's leader is ``<name>-<group
    index>`` (its workers, ``<name>-<group>-<index>``, export no metrics).
    """
    ref = isvc.ref
    if isvc.parallelism.multi_node:
        return f'namespace="{ref.namespace}",pod=~"{ref.name}-[0-9]+"'
    return f'namespace="{ref.namespace}",pod=~"{ref.name}-[a-z0-9]+-[a-z0-9]+"'


def trigger_queries(isvc: InferenceService) -> list[tuple[str, str, float]]:
    """(trigger name, PromQL returning one number, per-pod threshold) for every target set.

    Gauges are folded per pod first (``max by (pod)``: a pod exports one series per served model
    name), then summed over the pods; the preemption counter is a rate summed over its modes.
    """
    a = isvc.autoscaling
    sel = pod_matchers(isvc)
    window = PREEMPTION_RATE_WINDOW
    candidates = [
        (
            "kv-cache-usage",
            f"sum(max by (namespace, pod) (quire_kv_cache_usage_ratio{{{sel}}}))",
            a.target_kv_cache_utilization,
        ),
        (
            "kv-cache-demand",
            f"sum(max by (namespace, pod) (quire_kv_cache_demand_ratio{{{sel}}}))",
            a.target_kv_cache_demand,
        ),
        ("queue-depth", f"sum(quire_num_requests_waiting{{{sel}}})", a.target_queue_depth),
        (
            "preemption-rate",
            f"sum(rate(quire_preemptions_total{{{sel}}}[{window}]))",
            a.target_preemption_rate,
        ),
    ]
    return [(name, query, target) for name, query, target in candidates if target is not None]


def held_requests_query(isvc: InferenceService) -> str:
    """Requests the Endpoint Picker's flow control holds for this InferenceService's pool.

    The picker labels its gauge ``inference_pool`` with its ``--pool-name`` (the
    InferenceService's name), and the scraper adds ``namespace``; the sum folds its
    ``fairness_id``/``priority``/model series into one number.
    """
    ref = isvc.ref
    return (
        "sum(inference_extension_flow_control_queue_size"
        f'{{namespace="{ref.namespace}",inference_pool="{ref.name}"}})'
    )


def _held_requests_trigger(isvc: InferenceService, address: str) -> dict[str, Any]:
    """Wakes the Deployment from zero: active as soon as one request is held (KEDA activates a
    trigger whose value exceeds ``activationThreshold``). Above zero the held requests are the
    backlog the engines' own queues no longer show, so they also count per replica like
    ``targetQueueDepth``."""
    target = isvc.autoscaling.target_queue_depth or HELD_PER_REPLICA
    return {
        "type": "prometheus",
        "name": HELD_TRIGGER,
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": address,
            "query": held_requests_query(isvc),
            "threshold": _number(target),
            "activationThreshold": "0",
        },
    }


def _number(value: float) -> str:
    """KEDA reads thresholds as strings of plain decimals: 5.0 -> "5", 0.8 -> "0.8"."""
    return f"{value:g}"


def build_scaled_object(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any] | None:
    """A keda.sh/v1alpha1 ScaledObject on the Deployment; None unless autoscaling is on with
    backend keda. Raises ``ValueError`` when no Prometheus address is known."""
    a = isvc.autoscaling
    if not a.enabled or a.backend is not AutoscalingBackend.KEDA:
        return None
    address = a.keda.server_address or config.prometheus_address
    if address is None:
        raise ValueError(
            "autoscaling.backend keda needs a Prometheus address: set "
            "spec.autoscaling.keda.serverAddress or the operator's --prometheus-address "
            "(chart value autoscaling.prometheusAddress)"
        )
    triggers = [
        {
            "type": "prometheus",
            "name": name,
            "metricType": "AverageValue",
            "metadata": {"serverAddress": address, "query": query, "threshold": _number(target)},
        }
        for name, query, target in trigger_queries(isvc)
    ]
    if a.scales_to_zero:
        triggers.append(_held_requests_trigger(isvc, address))
    spec: dict[str, Any] = {
        "scaleTargetRef": scale_target(isvc),
        "minReplicaCount": a.min_replicas,
        "maxReplicaCount": a.max_replicas,
        "pollingInterval": a.keda.polling_interval_s,
        "cooldownPeriod": a.keda.cooldown_period_s,
        # Deleting the ScaledObject (a switch back to the hpa backend) leaves the replicas as they
        # are, so the switch causes no replica jump.
        "advanced": {"restoreToOriginalReplicaCount": False},
        "triggers": triggers,
    }
    if a.behavior:
        spec["advanced"]["horizontalPodAutoscalerConfig"] = {"behavior": dict(a.behavior)}
    if a.keda.fallback_failure_threshold is not None and a.keda.fallback_replicas is not None:
        spec["fallback"] = {
            "failureThreshold": a.keda.fallback_failure_threshold,
            "replicas": a.keda.fallback_replicas,
        }
    return {
        "apiVersion": Kind.SCALED_OBJECT.api_version,
        "kind": Kind.SCALED_OBJECT.value,
        "metadata": meta.object_meta(isvc.ref),
        "spec": spec,
    }


def build_autoscalers(
    isvc: InferenceService, config: OperatorConfig
) -> list[tuple[Kind, dict[str, Any] | None]]:
    """(kind, object or None) for both backends; at most one is not None."""
    hpa = build_hpa(isvc) if isvc.autoscaling.backend is AutoscalingBackend.HPA else None
    return [(Kind.HPA, hpa), (Kind.SCALED_OBJECT, build_scaled_object(isvc, config))]
