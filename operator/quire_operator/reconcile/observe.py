"""What one reconcile saw -> ``status.conditions.Observation``: our children as applied, plus
the pods and the Prometheus reading that explain them.

Reads only what the status needs and only when it needs it: pods while a Deployment is not
settled (during a rollout a new pod may be stuck behind old ready ones), the download Job's pods
while the spec has a model cache, the held requests while a service that scales to zero wakes.
The spec is the reconcile's one typed view: an ``InvalidSpec`` still reports through its
``Identity`` (URL, API key, routing, scale to zero), never by reading the custom object again.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from quire_operator import meta
from quire_operator.builders.autoscaling import held_requests_query
from quire_operator.builders.deployment import cache_claim_name
from quire_operator.builders.desired import Wanted, download_job
from quire_operator.builders.endpoint_picker import EPP_APP, PREFIX_BLOCKS_LABEL
from quire_operator.builders.host_memory import bytes_quantity, limit_warning, tier_bytes_per_pod
from quire_operator.builders.inference_pool import epp_name
from quire_operator.children import TIMEOUT
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.meta import ChildKey
from quire_operator.observed import prometheus
from quire_operator.observed.views import (
    AutoscalerView,
    DeploymentView,
    PodView,
    parse_autoscaler,
    parse_deployment,
    parse_download,
    parse_job,
    parse_leader_worker_set,
    parse_pod,
    parse_pool_parents,
)
from quire_operator.reconcile.adapters import AdapterSync
from quire_operator.reconcile.converge import Ours
from quire_operator.spec.view import Identity, InferenceService, InvalidSpec, RoutingMode
from quire_operator.status.conditions import (
    CacheObservation,
    HostTierObservation,
    Observation,
    Problem,
    RoutingObservation,
)

# The label the Job controller puts on a Job's pods.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


def _autoscaler(name: str, ours: Ours) -> AutoscalerView | None:
    """The HPA or ScaledObject this InferenceService owns, as last applied (the apply's answer
    carries its status)."""
    for kind in (Kind.HPA, Kind.SCALED_OBJECT):
        found = ours.get(ChildKey(kind, name))
        if found is not None:
            return parse_autoscaler(found)
    return None


def _engine_view(name: str, ours: Ours) -> DeploymentView | None:
    """The engine's Deployment, or its LeaderWorkerSet (counted in groups), as it now is."""
    if (found := ours.get(ChildKey(Kind.DEPLOYMENT, name))) is not None:
        return parse_deployment(found)
    if (found := ours.get(ChildKey(Kind.LEADER_WORKER_SET, name))) is not None:
        return parse_leader_worker_set(found)
    return None


def _host_tier(isvc: InferenceService | None) -> HostTierObservation | None:
    """The host tier as the spec sizes it; None without one (or for an invalid spec)."""
    if isvc is None or not isvc.engine.kv_offloading_size_gib:
        return None
    routed = isvc.routing.mode is RoutingMode.INFERENCE_POOL
    return HostTierObservation(
        size_gib=isvc.engine.kv_offloading_size_gib,
        memory_per_pod=bytes_quantity(tier_bytes_per_pod(isvc)),
        picker_capacity_label=PREFIX_BLOCKS_LABEL if routed else None,
        warning=limit_warning(isvc),
    )


class Observer:
    """Lists pods and asks Prometheus for one reconcile; holds no state between calls."""

    def __init__(self, api: client.ApiClient, config: OperatorConfig) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)
        self._config = config

    def observe(
        self,
        spec: InferenceService | InvalidSpec,
        problem: Problem | None,
        ours: Ours,
        cache: Wanted,
        adapters: AdapterSync | None = None,
    ) -> Observation:
        """``cache``: the model cache's children as built for this reconcile (empty for an
        invalid spec); ``adapters``: what the adapter loader found (None without spec.lora)."""
        identity: Identity = spec.identity
        namespace, name = identity.ref.namespace, identity.ref.name
        isvc = spec if isinstance(spec, InferenceService) else None
        deployment = _engine_view(name, ours)
        domain = self._config.cluster_domain
        return Observation(
            generation=identity.generation,
            url=f"http://{name}.{namespace}.svc.{domain}:{identity.port}",
            selector=meta.selector_string(name),
            api_key=identity.api_key,
            problem=problem,
            deployment=deployment,
            pods=self._pods_if_unsettled(namespace, meta.selector_string(name), deployment),
            routing=self._routing(identity, ours) if identity.routed else None,
            autoscaler=_autoscaler(name, ours),
            scales_to_zero=identity.scales_to_zero,
            held=self._held_while_waking(isvc, deployment),
            model_cache=self._cache(isvc, ours, cache),
            host_tier=_host_tier(isvc),
            adapters=adapters.adapters if adapters is not None else None,
        )

    def _held_while_waking(
        self, isvc: InferenceService | None, deployment: DeploymentView | None
    ) -> int | None:
        """Requests the picker holds, read from Prometheus only while a service that scales to
        zero has replicas wanted and none ready (it is waking); None otherwise or unknown."""
        if isvc is None or not isvc.autoscaling.scales_to_zero or deployment is None:
            return None
        if deployment.desired == 0 or deployment.ready > 0:
            return None
        address = isvc.autoscaling.keda.server_address or self._config.prometheus_address
        if address is None:
            return None
        held = prometheus.instant_value(address, held_requests_query(isvc))
        return None if held is None else round(held)

    def _cache(
        self, isvc: InferenceService | None, ours: Ours, cache: Wanted
    ) -> CacheObservation | None:
        """The cache's claim, its download Job and the Job's pods, when the spec asks for it."""
        job_name = download_job(cache)
        if isvc is None or job_name is None:
            return None  # no cache, or an invalid spec (reported as InvalidSpec)
        claim = cache_claim_name(isvc.ref.name)
        found_claim = ours.get(ChildKey(Kind.PVC, claim))
        found_job = ours.get(ChildKey(Kind.JOB, job_name))
        pods: list[dict[str, Any]] = []
        if found_job is not None:
            listed = self._core.list_namespaced_pod(
                isvc.ref.namespace,
                label_selector=f"{JOB_NAME_LABEL}={job_name}",
                _request_timeout=TIMEOUT,
            )
            pods = self._api.sanitize_for_serialization(listed)["items"]
        return CacheObservation(
            claim=claim,
            claim_phase=(found_claim.get("status") or {}).get("phase") if found_claim else None,
            job=job_name,
            download=parse_job(found_job) if found_job is not None else None,
            pods=[parse_pod(pod) for pod in pods],
            outcome=parse_download(pods),
        )

    def _routing(self, identity: Identity, ours: Ours) -> RoutingObservation:
        """The pool and the picker as they now are (the spec asks for routing)."""
        namespace, name = identity.ref.namespace, identity.ref.name
        picker_name = epp_name(name)
        found = ours.get(ChildKey(Kind.DEPLOYMENT, picker_name))
        picker = parse_deployment(found) if found is not None else None
        pool = ours.get(ChildKey(Kind.INFERENCE_POOL, name))
        selector = meta.selector_string(name, EPP_APP)
        return RoutingObservation(
            pool=name,
            endpoint_picker=picker_name,
            picker=picker,
            picker_pods=self._pods_if_unsettled(namespace, selector, picker),
            parents=parse_pool_parents(pool) if pool is not None else None,
        )

    def _pods_if_unsettled(
        self, namespace: str, selector: str, deployment: DeploymentView | None
    ) -> list[PodView]:
        """A Deployment's pods (by its selector), unless every replica runs the current template
        and is ready (then they have nothing to explain)."""
        if deployment is None or deployment.settled:
            return []
        pods = self._core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=TIMEOUT
        )
        items = self._api.sanitize_for_serialization(pods)["items"]
        return [parse_pod(item) for item in items]
