"""Level-triggered reconcile of one InferenceService against the API server.

Every trigger (the InferenceService created, changed or seen at startup; a child object or pod
changed or deleted; a retry; the periodic resync) runs the same ``Reconciler.reconcile(namespace,
name)``: read the latest InferenceService, check that each child name is free or already ours,
server-side apply the children, delete those it no longer needs (an HPA or PDB, the routing
objects when routing is turned off), and write the status if it changed (with one Event per
transition). Reading the latest object instead of the event's copy means a late event can never
re-apply an older spec.

Ownership:
- A child is ours only if its controller owner reference carries this InferenceService's uid.
  An object of the same name without it (made by helm, by hand, left over from a deleted
  InferenceService of the same name) is never applied over, adopted or deleted: the reconcile
  applies nothing, reports ``Degraded`` with reason ``NotOwned`` naming it, and asks to be
  retried, so it converges once that object is gone. An apply to an object found ours names its
  uid, so one replaced meanwhile is refused by the API server; only an object created in the
  moment between finding the name free and the apply would be taken over (server-side apply has
  no "create only").
- Children are applied with the single field manager ``meta.FIELD_MANAGER`` and ``force=True``:
  the operator is their controller, so it takes back any field it sets (see deployment.py for
  ``spec.replicas`` under an HPA). It deletes only children that it owns, by uid precondition.
- Routing (``spec.routing.mode: InferencePool``) adds the InferencePool and the Endpoint Picker's
  objects (endpoint_picker.py) under the same rules. Where the API server does not serve
  InferencePools (no CRD), none of them is applied and the status says so (Degraded
  ``InferencePoolCRDMissing``), retried until the CRD appears.
- ``spec.parallelism.nodes`` > 1 replaces the Deployment with a LeaderWorkerSet
  (leader_worker_set.py); the other kind is deleted. Where the API server does not serve
  LeaderWorkerSets nothing is applied (the Deployment keeps serving) and the status says so
  (Degraded ``LeaderWorkerSetCRDMissing``), retried until the CRD appears.
- ``status`` of the InferenceService is written by merge patch under the same manager name.
- One lock per (namespace, name) stripe serializes reconciles of an object within the process;
  kopf peering keeps a second operator process paused, so nothing else writes these fields.
- The operator never reads Secrets: a missing API key or model token Secret shows in the pods'
  status (the kubelet's CreateContainerConfigError names it), which the status reports.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import zlib
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta, prometheus
from quire_operator.autoscaling import (
    HPA_KIND,
    SCALED_OBJECT_KIND,
    build_autoscalers,
    held_requests_query,
)
from quire_operator.children import TIMEOUT, Children
from quire_operator.config import OperatorConfig
from quire_operator.deployment import build_deployment, cache_claim_name
from quire_operator.endpoint_picker import EPP_APP, routing_children
from quire_operator.events import EventRecorder, transitions
from quire_operator.inference_pool import POOL_KIND, epp_name
from quire_operator.leader_worker_set import (
    LWS_GROUP,
    LWS_KIND,
    LWS_VERSION,
    build_leader_worker_set,
)
from quire_operator.meta import ChildKey
from quire_operator.metrics import OperatorMetrics
from quire_operator.model_cache import build_claim, build_job
from quire_operator.objects import build_pdb, build_service
from quire_operator.observed import (
    AutoscalerView,
    DeploymentView,
    PodView,
    controller_uid,
    parse_autoscaler,
    parse_deployment,
    parse_download,
    parse_job,
    parse_leader_worker_set,
    parse_pod,
    parse_pool_parents,
)
from quire_operator.spec import InferenceService, RoutingMode, parse
from quire_operator.status import (
    CacheObservation,
    Observation,
    Problem,
    RoutingObservation,
    build_status,
)

logger = logging.getLogger(__name__)

MERGE = "application/merge-patch+json"
_LOCK_STRIPES = 64
# The label the Job controller puts on a Job's pods.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# Failures worth retrying as they are: server errors, conflicts, throttling (no status: timeout,
# connection refused). Anything else is the API server refusing this spec: reported, not retried.
RETRIABLE_STATUSES = frozenset({409, 429})
_NO_LWS_CRD = (
    f"spec.parallelism.nodes above 1 runs each replica as a LeaderWorkerSet, but the API server "
    f"does not serve {LWS_GROUP}/{LWS_VERSION} LeaderWorkerSets: install the LeaderWorkerSet "
    "controller; nothing of the spec is applied until then"
)
_NO_POOL_CRD = (
    "spec.routing.mode is InferencePool but the API server does not serve "
    "inference.networking.k8s.io/v1 InferencePools: install the CRD (the chart's "
    "routing.installCRDs, or your Gateway implementation's); nothing of the routing is applied "
    "until then"
)


def retriable(err: ApiException) -> bool:
    return err.status is None or err.status >= 500 or err.status in RETRIABLE_STATUSES


def api_message(err: ApiException) -> str:
    """The API server's own sentence from an error response (its Status ``message``)."""
    try:
        return str(json.loads(err.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return f"{err.status} {err.reason}"


def _log_changes(namespace: str, name: str, before: dict[str, Any], after: dict[str, Any]) -> None:
    """One line per condition flip and per newly applied generation: the operator's story."""
    if before.get("observedGeneration") != after["observedGeneration"]:
        logger.info("%s/%s: reconciled generation %s", namespace, name, after["observedGeneration"])
    old = {c["type"]: c["status"] for c in before.get("conditions") or []}
    for condition in after["conditions"]:
        if old.get(condition["type"]) != condition["status"]:
            logger.info(
                "%s/%s: %s=%s (%s: %s)",
                namespace,
                name,
                condition["type"],
                condition["status"],
                condition["reason"],
                condition["message"],
            )


def _autoscaler(name: str, ours: dict[ChildKey, dict[str, Any]]) -> AutoscalerView | None:
    """The HPA or ScaledObject this InferenceService owns, as last applied (the apply's answer
    carries its status)."""
    for kind in (HPA_KIND, SCALED_OBJECT_KIND):
        found = ours.get(ChildKey(kind, name))
        if found is not None:
            return parse_autoscaler(found)
    return None


def _scales_to_zero(body: dict[str, Any]) -> bool:
    autoscaling = body["spec"].get("autoscaling") or {}
    return bool(autoscaling.get("enabled")) and autoscaling.get("minReplicas") == 0


def _engine_view(name: str, ours: dict[ChildKey, dict[str, Any]]) -> DeploymentView | None:
    """The engine's Deployment, or its LeaderWorkerSet (counted in groups), as it now is."""
    if (found := ours.get(ChildKey("Deployment", name))) is not None:
        return parse_deployment(found)
    if (found := ours.get(ChildKey(LWS_KIND, name))) is not None:
        return parse_leader_worker_set(found)
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Holds the API clients; safe to call from kopf's handler threads and the requeue thread."""

    def __init__(
        self,
        api: client.ApiClient,
        config: OperatorConfig,
        now: Callable[[], str] = _now,
        events: EventRecorder | None = None,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self._api = api
        self._config = config
        self._now = now
        self._events = events if events is not None else EventRecorder(api)
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self._core = client.CoreV1Api(api)
        self._children = Children(api)
        self._custom = client.CustomObjectsApi(api)
        self._locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]

    def reconcile(self, namespace: str, name: str) -> Problem | None:
        """Converge one InferenceService; returns why its spec is not applied, if it is not.
        Raises ``ApiException`` for failures worth retrying (``retriable``)."""
        stripe = zlib.crc32(f"{namespace}/{name}".encode()) % _LOCK_STRIPES
        with self._locks[stripe]:
            body = self._read_inference_service(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None  # gone or going: the garbage collector removes the children
            problem, ours = self._converge(body)
            deployment = _engine_view(name, ours)
            domain, port = self._config.cluster_domain, body["spec"]["service"]["port"]
            observed = Observation(
                generation=int(body["metadata"].get("generation", 0)),
                url=f"http://{name}.{namespace}.svc.{domain}:{port}",
                selector=meta.selector_string(name),
                api_key=bool(body["spec"].get("apiKeySecretRef")),
                problem=problem,
                deployment=deployment,
                pods=self._pods_if_unsettled(namespace, meta.selector_string(name), deployment),
                routing=self._observe_routing(body, ours),
                autoscaler=_autoscaler(name, ours),
                scales_to_zero=_scales_to_zero(body),
                held=self._held_while_waking(body, deployment),
                model_cache=self._observe_cache(body, ours),
            )
            previous = body.get("status") or {}
            status = build_status(observed, previous, self._now())
            if status != previous:
                self._write_status(namespace, name, status, previous)
                _log_changes(namespace, name, previous, status)
                for transition in transitions(previous, status):
                    self._events.post(body, transition)
                    self.metrics.count(body, transition)
            return problem

    def _held_while_waking(
        self, body: dict[str, Any], deployment: DeploymentView | None
    ) -> int | None:
        """Requests the picker holds, read from Prometheus only while a service that scales to
        zero has replicas wanted and none ready (it is waking); None otherwise or unknown."""
        if not _scales_to_zero(body) or deployment is None:
            return None
        if deployment.desired == 0 or deployment.ready > 0:
            return None
        try:
            isvc = parse(body)
        except (ValueError, KeyError):
            return None
        address = isvc.autoscaling.keda.server_address or self._config.prometheus_address
        if address is None:
            return None
        held = prometheus.instant_value(address, held_requests_query(isvc))
        return None if held is None else round(held)

    def _converge(
        self, body: dict[str, Any]
    ) -> tuple[Problem | None, dict[ChildKey, dict[str, Any]]]:
        """Apply the children; (why not, our children as they now are)."""
        metadata = body["metadata"]
        namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
        try:
            isvc = parse(body)
            wanted = self._build(isvc)
        except (ValueError, KeyError) as err:
            invalid = Problem("InvalidSpec", f"spec cannot be applied: {err}")
            engines = [ChildKey("Deployment", name), ChildKey(LWS_KIND, name)]
            return invalid, self._ours(namespace, uid, engines)
        if isvc.parallelism.multi_node and not self._children.served(LWS_KIND):
            # Nothing is applied: the Deployment keeps serving until the LeaderWorkerSet can
            # replace it (retried, so installing the controller is all it takes).
            missing = Problem("LeaderWorkerSetCRDMissing", _NO_LWS_CRD, retry=True)
            engines = [ChildKey("Deployment", name), ChildKey(LWS_KIND, name)]
            return missing, self._ours(namespace, uid, engines)
        unserved = None
        if isvc.routing.enabled and not self._children.served(POOL_KIND):
            # Nothing of the routing is applied (a picker without its pool would only crash);
            # retried, so installing the CRD is all it takes.
            unserved = Problem("InferencePoolCRDMissing", _NO_POOL_CRD, retry=True)
        else:
            wanted.update(routing_children(isvc, self._config))
        existing = {key: self._children.read(key.kind, namespace, key.name) for key in wanted}
        ours = {key: obj for key, obj in existing.items() if obj and controller_uid(obj) == uid}
        foreign = [
            key
            for key, obj in existing.items()
            if obj is not None and key not in ours and wanted[key] is not None
        ]
        if foreign:
            named = ", ".join(f'{key.kind} "{key.name}"' for key in foreign)
            verb = "exists" if len(foreign) == 1 else "exist"
            message = (
                f"{named} already {verb} and is not controlled by this InferenceService; it is "
                "left untouched and nothing is applied until it is deleted or renamed"
            )
            return Problem("NotOwned", message, retry=True), ours
        # Deletions first: a backend switch removes the old autoscaler before the new one exists,
        # so two autoscalers never target the Deployment at once (the HPA controller then scales
        # neither).
        for key, child in sorted(wanted.items(), key=lambda key_child: key_child[1] is not None):
            try:
                if child is not None:
                    uid_now = ours[key]["metadata"]["uid"] if key in ours else None
                    ours[key] = self._children.apply(child, uid_now)
                elif key in ours:
                    self._children.delete(
                        key.kind, namespace, key.name, ours.pop(key)["metadata"]["uid"]
                    )
                    logger.info("deleted %s %s/%s (not in the spec)", key.kind, namespace, key.name)
            except ApiException as err:
                if retriable(err):
                    raise
                message = api_message(err)
                if key.kind == "ScaledObject" and err.status == 404:
                    message = "KEDA is not installed (the API server has no keda.sh/v1alpha1)"
                return Problem("ApplyFailed", f"{key.kind} {key.name}: {message}"), ours
        return unserved, ours

    def _ours(
        self, namespace: str, uid: str, keys: list[ChildKey]
    ) -> dict[ChildKey, dict[str, Any]]:
        """Those of ``keys`` that exist and are controlled by the InferenceService ``uid``."""
        found = {key: self._children.read(key.kind, namespace, key.name) for key in keys}
        return {key: obj for key, obj in found.items() if obj and controller_uid(obj) == uid}

    def _build(self, isvc: InferenceService) -> dict[ChildKey, dict[str, Any] | None]:
        """The engine's child objects -> their applied configuration, or None where the spec
        wants none. Raises ``ValueError`` for a spec that cannot be built (a KEDA backend with no
        Prometheus address anywhere)."""
        name = isvc.ref.name
        cache = isvc.model.cache
        # The cache's claim is deleted when the cache is turned off; its Jobs, finished, stay
        # as records until the InferenceService goes.
        model_cache: dict[ChildKey, dict[str, Any] | None] = {
            ChildKey("PersistentVolumeClaim", cache_claim_name(name)): None
        }
        if cache is not None:
            job = build_job(isvc, self._config)
            model_cache = {
                ChildKey("PersistentVolumeClaim", cache_claim_name(name)): build_claim(isvc, cache),
                ChildKey("Job", job["metadata"]["name"]): job,
            }
        # A multi-node replica is a LeaderWorkerSet group instead of a Deployment's pod; the other
        # one is deleted when the spec switches (None), so the kinds never run side by side.
        multi = isvc.parallelism.multi_node
        return {
            **model_cache,
            ChildKey("Deployment", name): None if multi else build_deployment(isvc, self._config),
            ChildKey(LWS_KIND, name): build_leader_worker_set(isvc, self._config)
            if multi
            else None,
            ChildKey("Service", name): build_service(isvc),
            **{ChildKey(kind, name): obj for kind, obj in build_autoscalers(isvc, self._config)},
            ChildKey("PodDisruptionBudget", name): build_pdb(isvc),
        }

    def _observe_cache(
        self, body: dict[str, Any], ours: dict[ChildKey, dict[str, Any]]
    ) -> CacheObservation | None:
        """The cache's claim, its download Job and the Job's pods, when the spec asks for it."""
        if not (body["spec"].get("model") or {}).get("cache"):
            return None
        try:
            isvc = parse(body)
        except (ValueError, KeyError):
            return None  # reported as InvalidSpec
        claim, job = cache_claim_name(isvc.ref.name), build_job(isvc, self._config)
        job_name = job["metadata"]["name"]
        found_claim = ours.get(ChildKey("PersistentVolumeClaim", claim))
        found_job = ours.get(ChildKey("Job", job_name))
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

    def _observe_routing(
        self, body: dict[str, Any], ours: dict[ChildKey, dict[str, Any]]
    ) -> RoutingObservation | None:
        """The pool and the picker as they now are, when the spec asks for routing."""
        routing = body["spec"].get("routing") or {}
        if routing.get("mode") != RoutingMode.INFERENCE_POOL.value:
            return None
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        picker_name = epp_name(name)
        found = ours.get(ChildKey("Deployment", picker_name))
        picker = parse_deployment(found) if found is not None else None
        pool = ours.get(ChildKey(POOL_KIND, name))
        selector = meta.selector_string(name, EPP_APP)
        return RoutingObservation(
            pool=name,
            endpoint_picker=picker_name,
            picker=picker,
            picker_pods=self._pods_if_unsettled(namespace, selector, picker),
            parents=parse_pool_parents(pool) if pool is not None else None,
        )

    def _read_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            body = self._custom.get_namespaced_custom_object(
                meta.GROUP, meta.VERSION, namespace, meta.PLURAL, name, _request_timeout=TIMEOUT
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        if not isinstance(body, dict):  # the client types custom objects as `object`
            raise TypeError(f"expected a JSON object for {namespace}/{name}, got {type(body)}")
        return body

    def _pods_if_unsettled(
        self, namespace: str, selector: str, deployment: DeploymentView | None
    ) -> list[PodView]:
        """A Deployment's pods (by its selector), unless every replica runs the current template
        and is ready (then they have nothing to explain); during a rollout a new pod may be
        stuck behind old ready ones."""
        if deployment is None or deployment.settled:
            return []
        pods = self._core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=TIMEOUT
        )
        items = self._api.sanitize_for_serialization(pods)["items"]
        return [parse_pod(item) for item in items]

    def _write_status(
        self, namespace: str, name: str, status: dict[str, Any], previous: dict[str, Any]
    ) -> None:
        # A merge patch keeps keys it does not name: a key the status no longer has (routing
        # turned off) is removed by naming it with null.
        gone = {key: None for key in previous.keys() - status.keys()}
        try:
            self._custom.patch_namespaced_custom_object_status(
                meta.GROUP,
                meta.VERSION,
                namespace,
                meta.PLURAL,
                name,
                {"status": {**status, **gone}},
                field_manager=meta.FIELD_MANAGER,
                _content_type=MERGE,
                _request_timeout=TIMEOUT,
            )
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing left to report on
                raise
