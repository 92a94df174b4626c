"""Level-triggered reconcile of one InferenceService against the API server.

Every trigger (the InferenceService created, changed or seen at startup; a child object or pod
changed or deleted) runs the same ``Reconciler.reconcile(namespace, name)``: read the latest
InferenceService, server-side apply its children, delete the HPA/PDB it no longer needs, and write
the status if it changed. Reading the latest object instead of the event's copy means a late
event can never re-apply an older spec.

Ownership:
- Children are applied with the single field manager ``meta.FIELD_MANAGER`` and ``force=True``:
  the operator is their controller, so it takes back any field it sets (see deployment.py for
  ``spec.replicas`` under an HPA). It deletes only an HPA/PDB that it owns.
- ``status`` of the InferenceService is written by merge patch under the same manager name.
- One lock per (namespace, name) stripe serializes reconciles of an object within the process;
  kopf peering keeps a second operator process paused, so nothing else writes these fields.
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
from quire_operator.autoscaling import (
    KEDA_GROUP,
    KEDA_VERSION,
    SCALED_OBJECT_PLURAL,
    build_autoscalers,
)
from quire_operator.config import OperatorConfig
from quire_operator.deployment import build_deployment
from quire_operator.objects import build_pdb, build_service
from quire_operator.spec import InferenceService, parse
from quire_operator.status import Observation, Problem, build_status

logger = logging.getLogger(__name__)

APPLY = "application/apply-patch+yaml"  # JSON is YAML, and the client sends dict bodies as JSON
MERGE = "application/merge-patch+json"
# (connect, read) seconds for every call: a hung request must not hold an object's lock forever.
TIMEOUT = (10, 60)
_LOCK_STRIPES = 64


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
    """Holds the API clients; safe to call from kopf's handler threads."""

    def __init__(
        self, api: client.ApiClient, config: OperatorConfig, now: Callable[[], str] = _now
    ) -> None:
        self._api = api
        self._config = config
        self._now = now
        self._core = client.CoreV1Api(api)
        self._apps = client.AppsV1Api(api)
        self._autoscaling = client.AutoscalingV2Api(api)
        self._policy = client.PolicyV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]

    def reconcile(self, namespace: str, name: str) -> Problem | None:
        """Converge one InferenceService; returns why its spec is not applied, if it is not.
        Raises ``ApiException`` for failures worth retrying (server errors, conflicts)."""
        stripe = zlib.crc32(f"{namespace}/{name}".encode()) % _LOCK_STRIPES
        with self._locks[stripe]:
            body = self._read_inference_service(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None  # gone or going: the garbage collector removes the children
            problem, deployment = self._converge(body)
            domain, port = self._config.cluster_domain, body["spec"]["service"]["port"]
            observed = Observation(
                generation=int(body["metadata"].get("generation", 0)),
                url=f"http://{name}.{namespace}.svc.{domain}:{port}",
                selector=meta.selector_string(name),
                problem=problem,
                deployment=deployment,
                pods=self._pods_if_unready(namespace, name, deployment),
            )
            previous = body.get("status") or {}
            status = build_status(observed, previous, self._now())
            if status != previous:
                self._write_status(namespace, name, status)
                _log_changes(namespace, name, previous, status)
            return problem

    def _converge(self, body: dict[str, Any]) -> tuple[Problem | None, dict[str, Any] | None]:
        """Apply the children; (why not, the Deployment as it now is)."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        try:
            isvc = parse(body)
        except (ValueError, KeyError) as err:
            invalid = Problem("InvalidSpec", f"spec cannot be applied: {err}")
            return invalid, self._read_deployment(namespace, name)
        missing = self._check_secret(isvc)
        if missing is not None:
            # Keep whatever runs now: a replica that already has its model keeps serving.
            return missing, self._read_deployment(namespace, name)
        try:
            autoscalers = build_autoscalers(isvc, self._config)
        except ValueError as err:
            invalid = Problem("InvalidSpec", f"spec cannot be applied: {err}")
            return invalid, self._read_deployment(namespace, name)
        children = [
            ("Deployment", build_deployment(isvc, self._config)),
            ("Service", build_service(isvc)),
            *autoscalers,
            ("PodDisruptionBudget", build_pdb(isvc)),
        ]
        # Deletions first: a backend switch removes the old autoscaler before the new one exists,
        # so two HPAs never target the Deployment at once (the HPA controller then scales none).
        children.sort(key=lambda kind_child: kind_child[1] is not None)
        deployment = None
        for kind, child in children:
            try:
                if child is None:
                    self._delete_if_owned(kind, isvc)
                    continue
                applied = self._apply(child)
            except ApiException as err:
                if err.status is None or err.status >= 500 or err.status in (409, 429):
                    raise
                message = api_message(err)
                if kind == "ScaledObject" and err.status == 404:
                    message = "KEDA is not installed (the API server has no keda.sh/v1alpha1)"
                problem = Problem("ApplyFailed", f"{kind} {name}: {message}")
                return problem, deployment or self._read_deployment(namespace, name)
            if kind == "Deployment":
                deployment = applied
        return None, deployment

    def _check_secret(self, isvc: InferenceService) -> Problem | None:
        ref = isvc.model.hf_token
        if ref is None:
            return None
        where = f'Secret "{ref.name}" (spec.model.hfTokenSecretRef)'
        try:
            secret = self._core.read_namespaced_secret(
                ref.name, isvc.ref.namespace, _request_timeout=TIMEOUT
            )
        except ApiException as err:
            if err.status == 404:
                message = f'{where} not found in namespace "{isvc.ref.namespace}"'
                return Problem("SecretNotFound", message, retry=True)
            raise
        if ref.key not in (secret.data or {}):
            return Problem("SecretKeyNotFound", f'{where} has no key "{ref.key}"', retry=True)
        return None

    def _apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        patchers: dict[str, Callable[..., Any]] = {
            "Deployment": self._apps.patch_namespaced_deployment,
            "Service": self._core.patch_namespaced_service,
            "HorizontalPodAutoscaler": self._autoscaling.patch_namespaced_horizontal_pod_autoscaler,
            "PodDisruptionBudget": self._policy.patch_namespaced_pod_disruption_budget,
            "ScaledObject": self._patch_scaled_object,
        }
        metadata = obj["metadata"]
        result = patchers[obj["kind"]](
            metadata["name"],
            metadata["namespace"],
            obj,
            field_manager=meta.FIELD_MANAGER,
            force=True,
            _content_type=APPLY,
            _request_timeout=TIMEOUT,
        )
        applied: dict[str, Any] = self._api.sanitize_for_serialization(result)
        return applied

    def _delete_if_owned(self, kind: str, isvc: InferenceService) -> None:
        """Delete this InferenceService's HPA, ScaledObject or PDB if it has one; never someone
        else's."""
        readers: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "HorizontalPodAutoscaler": (
                self._autoscaling.read_namespaced_horizontal_pod_autoscaler,
                self._autoscaling.delete_namespaced_horizontal_pod_autoscaler,
            ),
            "PodDisruptionBudget": (
                self._policy.read_namespaced_pod_disruption_budget,
                self._policy.delete_namespaced_pod_disruption_budget,
            ),
            "ScaledObject": (self._read_scaled_object, self._delete_scaled_object),
        }
        read, delete = readers[kind]
        ref = isvc.ref
        try:
            found = read(ref.name, ref.namespace, _request_timeout=TIMEOUT)
            existing = self._api.sanitize_for_serialization(found)
            if meta.owned_by(existing, ref):
                uid = existing["metadata"]["uid"]
                options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
                delete(ref.name, ref.namespace, body=options, _request_timeout=TIMEOUT)
                logger.info("deleted %s %s/%s (not in the spec)", kind, ref.namespace, ref.name)
        except ApiException as err:
            if err.status not in (404, 409):  # already gone, or replaced meanwhile
                raise

    # KEDA's ScaledObject through the custom-objects API, in the typed clients' argument order.
    # Without KEDA installed, reading one answers 404 like a missing object: nothing to delete.
    def _patch_scaled_object(self, name: str, namespace: str, body: Any, **kwargs: Any) -> Any:
        return self._custom.patch_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, SCALED_OBJECT_PLURAL, name, body, **kwargs
        )

    def _read_scaled_object(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._custom.get_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, SCALED_OBJECT_PLURAL, name, **kwargs
        )

    def _delete_scaled_object(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._custom.delete_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, SCALED_OBJECT_PLURAL, name, **kwargs
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

    def _read_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            deployment = self._apps.read_namespaced_deployment(
                name, namespace, _request_timeout=TIMEOUT
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        found: dict[str, Any] = self._api.sanitize_for_serialization(deployment)
        return found

    def _pods_if_unready(
        self, namespace: str, name: str, deployment: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        """The pods, unless every replica runs the current template and is ready (then they
        have nothing to explain); during a rollout a new pod may be stuck behind old ready ones."""
        if deployment is None:
            return []
        desired = deployment.get("spec", {}).get("replicas", 1)
        status = deployment.get("status", {})
        counts = (status.get(key, 0) for key in ("replicas", "updatedReplicas", "readyReplicas"))
        if all(count == desired for count in counts):
            return []
        selector = meta.selector_string(name)
        pods = self._core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=TIMEOUT
        )
        items: list[dict[str, Any]] = self._api.sanitize_for_serialization(pods)["items"]
        return items

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
