"""API calls on the operator's child objects, by kind: read, server-side apply, delete; and
whether an optional kind is served.

Ownership rules live in reconcile/; this module only knows which client method serves which kind
(kinds.py says which kinds exist and which go through the custom-objects API). Every call carries
``TIMEOUT`` so a hung request cannot hold an object's lock forever, and results come back as API
JSON (camelCase dicts), the form the rest of the operator reads. ``retriable`` and
``api_message`` read the API server's refusals, for every caller of the API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.kinds import OPTIONAL, Kind

APPLY = "application/apply-patch+yaml"  # JSON is YAML, and the client sends dict bodies as JSON
# (connect, read) seconds for every call.
TIMEOUT = (10, 60)
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


@dataclass(frozen=True)
class _Calls:
    read: Callable[..., Any]
    patch: Callable[..., Any]
    delete: Callable[..., Any]


def _custom_calls(custom: client.CustomObjectsApi, kind: Kind) -> _Calls:
    """The custom-objects calls in the typed clients' argument order (name, namespace, ...)."""
    group, version, plural = kind.group, kind.version, kind.plural
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
    """The kinds an InferenceService owns (``kinds.OWNED``), behind one small interface. Those
    with an optional CRD (KEDA's ScaledObject, the InferencePool, the LeaderWorkerSet) go through
    the custom-objects API; where their CRD is not installed, reading one answers 404 like a
    missing object (nothing to delete) and applying one fails with 404 (reported as
    ApplyFailed). ``served`` tells the two cases apart before an apply."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        hpa, pdb = client.AutoscalingV2Api(api), client.PolicyV1Api(api)
        rbac, batch = client.RbacAuthorizationV1Api(api), client.BatchV1Api(api)
        self._custom = custom = client.CustomObjectsApi(api)
        typed = {
            Kind.DEPLOYMENT: _Calls(
                apps.read_namespaced_deployment,
                apps.patch_namespaced_deployment,
                apps.delete_namespaced_deployment,
            ),
            Kind.SERVICE: _Calls(
                core.read_namespaced_service,
                core.patch_namespaced_service,
                core.delete_namespaced_service,
            ),
            Kind.HPA: _Calls(
                hpa.read_namespaced_horizontal_pod_autoscaler,
                hpa.patch_namespaced_horizontal_pod_autoscaler,
                hpa.delete_namespaced_horizontal_pod_autoscaler,
            ),
            Kind.PDB: _Calls(
                pdb.read_namespaced_pod_disruption_budget,
                pdb.patch_namespaced_pod_disruption_budget,
                pdb.delete_namespaced_pod_disruption_budget,
            ),
            Kind.SERVICE_ACCOUNT: _Calls(
                core.read_namespaced_service_account,
                core.patch_namespaced_service_account,
                core.delete_namespaced_service_account,
            ),
            Kind.CONFIG_MAP: _Calls(
                core.read_namespaced_config_map,
                core.patch_namespaced_config_map,
                core.delete_namespaced_config_map,
            ),
            Kind.ROLE: _Calls(
                rbac.read_namespaced_role,
                rbac.patch_namespaced_role,
                rbac.delete_namespaced_role,
            ),
            Kind.ROLE_BINDING: _Calls(
                rbac.read_namespaced_role_binding,
                rbac.patch_namespaced_role_binding,
                rbac.delete_namespaced_role_binding,
            ),
            Kind.PVC: _Calls(
                core.read_namespaced_persistent_volume_claim,
                core.patch_namespaced_persistent_volume_claim,
                core.delete_namespaced_persistent_volume_claim,
            ),
            Kind.JOB: _Calls(
                batch.read_namespaced_job,
                batch.patch_namespaced_job,
                batch.delete_namespaced_job,
            ),
        }
        custom_calls = {kind: _custom_calls(custom, kind) for kind in OPTIONAL}
        self._calls: dict[Kind, _Calls] = {**typed, **custom_calls}

    @property
    def kinds(self) -> frozenset[Kind]:
        """The kinds this client can read, apply and delete (``kinds.OWNED``, a test checks)."""
        return frozenset(self._calls)

    def served(self, kind: Kind) -> bool:
        """Whether the API server serves ``kind`` (a custom kind: its CRD is installed), asked of
        discovery (/apis/GROUP/VERSION, which every authenticated client may read)."""
        try:
            found = self._custom.get_api_resources(
                kind.group, kind.version, _request_timeout=TIMEOUT
            )
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return any(resource.name == kind.plural for resource in found.resources)

    def read(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
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
            result = self._calls[Kind(obj["kind"])].patch(
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

    def delete(self, kind: Kind, namespace: str, name: str, uid: str) -> None:
        """Delete exactly the object with this uid (a precondition): if it was replaced
        meanwhile by someone else's, the API server refuses (409) and nothing is lost."""
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
        try:
            self._calls[kind].delete(name, namespace, body=options, _request_timeout=TIMEOUT)
        except ApiException as err:
            if err.status not in (404, 409):  # already gone, or replaced meanwhile
                raise
