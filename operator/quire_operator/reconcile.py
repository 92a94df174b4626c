"""Level-triggered reconcile of one InferenceService against the API server.

Every trigger (the InferenceService created, changed or seen at startup; a child object or pod
changed or deleted; a retry; the periodic resync) runs the same ``Reconciler.reconcile(namespace,
name)``: read the latest InferenceService, check that each child name is free or already ours,
server-side apply the children, delete the HPA/PDB it no longer needs, and write the status if
it changed (with one Event per transition). Reading the latest object instead of the event's
copy means a late event can never re-apply an older spec.

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
  ``spec.replicas`` under an HPA). It deletes only an HPA/PDB that it owns, by uid precondition.
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

from quire_operator import meta
from quire_operator.autoscaling import build_autoscalers
from quire_operator.children import TIMEOUT, Children
from quire_operator.config import OperatorConfig
from quire_operator.deployment import build_deployment
from quire_operator.events import EventRecorder, transitions
from quire_operator.objects import build_pdb, build_service
from quire_operator.observed import (
    DeploymentView,
    PodView,
    controller_uid,
    parse_deployment,
    parse_pod,
)
from quire_operator.spec import InferenceService, parse
from quire_operator.status import Observation, Problem, build_status

logger = logging.getLogger(__name__)

MERGE = "application/merge-patch+json"
_LOCK_STRIPES = 64
# Failures worth retrying as they are: server errors, conflicts, throttling (no status: timeout,
# connection refused). Anything else is the API server refusing this spec: reported, not retried.
RETRIABLE_STATUSES = frozenset({409, 429})


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
    ) -> None:
        self._api = api
        self._config = config
        self._now = now
        self._events = events if events is not None else EventRecorder(api)
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
            problem, found = self._converge(body)
            deployment = parse_deployment(found) if found is not None else None
            domain, port = self._config.cluster_domain, body["spec"]["service"]["port"]
            observed = Observation(
                generation=int(body["metadata"].get("generation", 0)),
                url=f"http://{name}.{namespace}.svc.{domain}:{port}",
                selector=meta.selector_string(name),
                api_key=bool(body["spec"].get("apiKeySecretRef")),
                problem=problem,
                deployment=deployment,
                pods=self._pods_if_unsettled(namespace, name, deployment),
            )
            previous = body.get("status") or {}
            status = build_status(observed, previous, self._now())
            if status != previous:
                self._write_status(namespace, name, status)
                _log_changes(namespace, name, previous, status)
                for transition in transitions(previous, status):
                    self._events.post(body, transition)
            return problem

    def _converge(self, body: dict[str, Any]) -> tuple[Problem | None, dict[str, Any] | None]:
        """Apply the children; (why not, our Deployment as it now is)."""
        metadata = body["metadata"]
        namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
        existing = {kind: self._children.read(kind, namespace, name) for kind in _KINDS}
        ours = {kind: obj for kind, obj in existing.items() if obj and controller_uid(obj) == uid}
        try:
            wanted = self._build(parse(body))
        except (ValueError, KeyError) as err:
            invalid = Problem("InvalidSpec", f"spec cannot be applied: {err}")
            return invalid, ours.get("Deployment")
        foreign = [
            kind
            for kind, obj in existing.items()
            if obj is not None and kind not in ours and wanted[kind] is not None
        ]
        if foreign:
            named = ", ".join(f'{kind} "{name}"' for kind in foreign)
            message = (
                f"{named} already exists and is not controlled by this InferenceService; it is "
                "left untouched and nothing is applied until it is deleted or renamed"
            )
            return Problem("NotOwned", message, retry=True), ours.get("Deployment")
        deployment = ours.get("Deployment")
        # Deletions first: a backend switch removes the old autoscaler before the new one exists,
        # so two autoscalers never target the Deployment at once (the HPA controller then scales
        # neither).
        for kind, child in sorted(wanted.items(), key=lambda kind_child: kind_child[1] is not None):
            try:
                if child is not None:
                    uid_now = ours[kind]["metadata"]["uid"] if kind in ours else None
                    applied = self._children.apply(child, uid_now)
                    deployment = applied if kind == "Deployment" else deployment
                elif kind in ours:
                    self._children.delete(kind, namespace, name, ours[kind]["metadata"]["uid"])
                    logger.info("deleted %s %s/%s (not in the spec)", kind, namespace, name)
            except ApiException as err:
                if retriable(err):
                    raise
                message = api_message(err)
                if kind == "ScaledObject" and err.status == 404:
                    message = "KEDA is not installed (the API server has no keda.sh/v1alpha1)"
                return Problem("ApplyFailed", f"{kind} {name}: {message}"), deployment
        return None, deployment

    def _build(self, isvc: InferenceService) -> dict[str, dict[str, Any] | None]:
        """Each child kind -> its applied configuration, or None where the spec wants none.
        Raises ``ValueError`` for a spec that cannot be built (a KEDA backend with no Prometheus
        address anywhere)."""
        return {
            "Deployment": build_deployment(isvc, self._config),
            "Service": build_service(isvc),
            **dict(build_autoscalers(isvc, self._config)),
            "PodDisruptionBudget": build_pdb(isvc),
        }

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
        self, namespace: str, name: str, deployment: DeploymentView | None
    ) -> list[PodView]:
        """The pods, unless every replica runs the current template and is ready (then they
        have nothing to explain); during a rollout a new pod may be stuck behind old ready ones."""
        if deployment is None or deployment.settled:
            return []
        selector = meta.selector_string(name)
        pods = self._core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=TIMEOUT
        )
        items = self._api.sanitize_for_serialization(pods)["items"]
        return [parse_pod(item) for item in items]

    def _write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            self._custom.patch_namespaced_custom_object_status(
                meta.GROUP,
                meta.VERSION,
                namespace,
                meta.PLURAL,
                name,
                {"status": status},
                field_manager=meta.FIELD_MANAGER,
                _content_type=MERGE,
                _request_timeout=TIMEOUT,
            )
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: nothing left to report on
                raise


# The child kinds, in apply order: the Deployment first (the HPA targets it).
_KINDS = (
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "ScaledObject",
    "PodDisruptionBudget",
)
