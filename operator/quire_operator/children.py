"""API calls on the operator's child objects, by kind: read, server-side apply, delete.

Ownership rules live in reconcile.py; this module only knows which client method serves which
kind. Every call carries ``TIMEOUT`` so a hung request cannot hold an object's lock forever, and
results come back as API JSON (camelCase dicts), the form the rest of the operator reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.autoscaling import KEDA_GROUP, KEDA_VERSION, SCALED_OBJECT_PLURAL
from quire_operator.inference_pool import POOL_GROUP, POOL_PLURAL, POOL_VERSION
from quire_operator.leader_worker_set import LWS_GROUP, LWS_KIND, LWS_PLURAL, LWS_VERSION

APPLY = "application/apply-patch+yaml"  # JSON is YAML, and the client sends dict bodies as JSON
# (connect, read) seconds for every call.
TIMEOUT = (10, 60)


@dataclass(frozen=True)
class _Calls:
    read: Callable[..., Any]
    patch: Callable[..., Any]
    delete: Callable[..., Any]


def _custom_calls(custom: client.CustomObjectsApi, group: str, version: str, plural: str) -> _Calls:
    """The custom-objects calls in the typed clients' argument order (name, namespace, ...)."""
    return _Calls(
        lambda name, ns, **kw: custom.get_namespaced_custom_object(
            group, version, ns, plural, name, **kw
        ),
        lambda name, ns, body, **kw: custom.patch_namespaced_custom_object(
            group, version, ns, plural, name, body, **kw
        ),
        lambda name, ns, **kw: custom.delete_namespaced_custom_object(
            group, version, ns, plural, name, **kw
        ),
    )


class Children:
    """The kinds an InferenceService owns, behind one small interface. KEDA's ScaledObject, the
    InferencePool and the LeaderWorkerSet go through the custom-objects API; where their CRD is
    not installed, reading one answers 404 like a missing object (nothing to delete) and applying
    one fails with 404 (reported as ApplyFailed). ``served`` tells the two cases apart before an
    apply."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        hpa, pdb = client.AutoscalingV2Api(api), client.PolicyV1Api(api)
        rbac, batch = client.RbacAuthorizationV1Api(api), client.BatchV1Api(api)
        self._custom = custom = client.CustomObjectsApi(api)
        self._calls = {
            "Deployment": _Calls(
                apps.read_namespaced_deployment,
                apps.patch_namespaced_deployment,
                apps.delete_namespaced_deployment,
            ),
            "Service": _Calls(
                core.read_namespaced_service,
                core.patch_namespaced_service,
                core.delete_namespaced_service,
            ),
            "HorizontalPodAutoscaler": _Calls(
                hpa.read_namespaced_horizontal_pod_autoscaler,
                hpa.patch_namespaced_horizontal_pod_autoscaler,
                hpa.delete_namespaced_horizontal_pod_autoscaler,
            ),
            "PodDisruptionBudget": _Calls(
                pdb.read_namespaced_pod_disruption_budget,
                pdb.patch_namespaced_pod_disruption_budget,
                pdb.delete_namespaced_pod_disruption_budget,
            ),
            "ServiceAccount": _Calls(
                core.read_namespaced_service_account,
                core.patch_namespaced_service_account,
                core.delete_namespaced_service_account,
            ),
            "ConfigMap": _Calls(
                core.read_namespaced_config_map,
                core.patch_namespaced_config_map,
                core.delete_namespaced_config_map,
            ),
            "Role": _Calls(
                rbac.read_namespaced_role,
                rbac.patch_namespaced_role,
                rbac.delete_namespaced_role,
            ),
            "RoleBinding": _Calls(
                rbac.read_namespaced_role_binding,
                rbac.patch_namespaced_role_binding,
                rbac.delete_namespaced_role_binding,
            ),
            "PersistentVolumeClaim": _Calls(
                core.read_namespaced_persistent_volume_claim,
                core.patch_namespaced_persistent_volume_claim,
                core.delete_namespaced_persistent_volume_claim,
            ),
            "Job": _Calls(
                batch.read_namespaced_job,
                batch.patch_namespaced_job,
                batch.delete_namespaced_job,
            ),
            "ScaledObject": _custom_calls(custom, KEDA_GROUP, KEDA_VERSION, SCALED_OBJECT_PLURAL),
            "InferencePool": _custom_calls(custom, POOL_GROUP, POOL_VERSION, POOL_PLURAL),
            LWS_KIND: _custom_calls(custom, LWS_GROUP, LWS_VERSION, LWS_PLURAL),
        }
        self._resources = {
            "InferencePool": (POOL_GROUP, POOL_VERSION, POOL_PLURAL),
            LWS_KIND: (LWS_GROUP, LWS_VERSION, LWS_PLURAL),
        }

    def served(self, kind: str) -> bool:
        """Whether the API server serves ``kind`` (a custom kind: its CRD is installed), asked of
        discovery (/apis/GROUP/VERSION, which every authenticated client may read)."""
        group, version, plural = self._resources[kind]
        try:
            found = self._custom.get_api_resources(group, version, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return any(resource.name == plural for resource in found.resources)

    def read(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as API JSON, or None when there is none."""
        try:
            found = self._calls[kind].read(name, namespace, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        obj: dict[str, Any] = self._api.sanitize_for_serialization(found)
        return obj

    def apply(self, obj: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
        """Server-side apply ``obj`` as the operator's field manager, taking its fields back.

        ``uid``: the object must still be that one (the one read and found ours). The API
        server refuses an apply whose metadata.uid differs from the live object's (422), so an
        object deleted and re-made by someone else since the read is never written; that is
        raised as a 409 Conflict, which the requeue retries (and the retry reports NotOwned).
        """
        metadata = obj["metadata"]
        body = obj if uid is None else {**obj, "metadata": {**metadata, "uid": uid}}
        try:
            result = self._calls[obj["kind"]].patch(
                metadata["name"],
                metadata["namespace"],
                body,
                field_manager=meta.FIELD_MANAGER,
                force=True,
                _content_type=APPLY,
                _request_timeout=TIMEOUT,
            )
        except ApiException as err:
            replaced = uid is not None and err.status in (409, 422) and "uid" in str(err.body)
            if replaced:
                reason = f"{obj['kind']} {metadata['name']} was replaced since it was read"
                raise ApiException(status=409, reason=reason) from err
            raise
        applied: dict[str, Any] = self._api.sanitize_for_serialization(result)
        return applied

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete exactly the object with this uid (a precondition): if it was replaced
        meanwhile by someone else's, the API server refuses (409) and nothing is lost."""
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
        try:
            self._calls[kind].delete(name, namespace, body=options, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status not in (404, 409):  # already gone, or replaced meanwhile
                raise
