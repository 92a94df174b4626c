"""Apply one InferenceService's children under the ownership rules; say why not where it cannot.

Ownership:
- A child is ours only if its controller owner reference carries this InferenceService's uid.
  An object of the same name without it (made by helm, by hand, left over from a deleted
  InferenceService of the same name) is never applied over, adopted or deleted: nothing is
  applied, the problem is ``NotOwned`` naming it, retried, so it converges once that object is
  gone. An apply to an object found ours names its uid, so one replaced meanwhile is refused by
  the API server; only an object created in the moment between finding the name free and the
  apply would be taken over (server-side apply has no "create only").
- Children are applied with the single field manager ``meta.FIELD_MANAGER`` and ``force=True``:
  the operator is their controller, so it takes back any field it sets (see
  builders/deployment.py for ``spec.replicas`` under an HPA). It deletes only children that it
  owns, by uid precondition.
- Routing (``spec.routing.mode: InferencePool``) adds the InferencePool and the Endpoint Picker's
  objects (builders/endpoint_picker.py) under the same rules. Where the API server does not serve
  InferencePools (no CRD), none of them is applied and the problem says so
  (``InferencePoolCRDMissing``), retried until the CRD appears.
- ``spec.parallelism.nodes`` > 1 replaces the Deployment with a LeaderWorkerSet
  (builders/leader_worker_set.py); the other kind is deleted. Where the API server does not
  serve LeaderWorkerSets nothing is applied (the Deployment keeps serving) and the problem says
  so (``LeaderWorkerSetCRDMissing``), retried until the CRD appears.
- An invalid spec (``InvalidSpec``) applies nothing: its engine's Deployment or LeaderWorkerSet,
  if ours, is still found, so the status keeps reporting the replicas that run.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes.client.exceptions import ApiException

from quire_operator.builders.desired import Wanted, engine_children, routing
from quire_operator.children import Children, api_message, retriable
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.meta import ChildKey, ObjectRef
from quire_operator.observed.views import controller_uid
from quire_operator.spec.view import InferenceService, InvalidSpec
from quire_operator.status.conditions import Problem

logger = logging.getLogger("quire_operator.reconcile")

# Our children as they now are (as read, or as the apply answered), by key.
Ours = dict[ChildKey, dict[str, Any]]

_LWS, _POOL, _KEDA = Kind.LEADER_WORKER_SET, Kind.INFERENCE_POOL, Kind.SCALED_OBJECT
_NO_LWS_CRD = (
    f"spec.parallelism.nodes above 1 runs each replica as a LeaderWorkerSet, but the API server "
    f"does not serve {_LWS.api_version} LeaderWorkerSets: install the LeaderWorkerSet "
    "controller; nothing of the spec is applied until then"
)
_NO_POOL_CRD = (
    "spec.routing.mode is InferencePool but the API server does not serve "
    f"{_POOL.api_version} InferencePools: install the CRD (the chart's "
    "routing.installCRDs, or your Gateway implementation's); nothing of the routing is applied "
    "until then"
)


def _invalid(error: str) -> Problem:
    return Problem("InvalidSpec", f"spec cannot be applied: {error}")


class Converger:
    """Applies and deletes children through ``Children``; holds no state between calls."""

    def __init__(self, children: Children, config: OperatorConfig) -> None:
        self._children = children
        self._config = config

    def converge(
        self, spec: InferenceService | InvalidSpec, cache: Wanted
    ) -> tuple[Problem | None, Ours]:
        """Apply the children (``cache``: the model cache's, already built); returns (why not,
        our children as they now are). Raises ``ApiException`` for failures worth retrying."""
        if isinstance(spec, InvalidSpec):
            return _invalid(spec.error), self._engines(spec.identity.ref)
        isvc = spec
        try:
            wanted = {**cache, **engine_children(isvc, self._config)}
        except (ValueError, KeyError) as err:
            return _invalid(str(err)), self._engines(isvc.ref)
        if isvc.parallelism.multi_node and not self._children.served(_LWS):
            # Nothing is applied: the Deployment keeps serving until the LeaderWorkerSet can
            # replace it (retried, so installing the controller is all it takes).
            missing = Problem("LeaderWorkerSetCRDMissing", _NO_LWS_CRD, retry=True)
            return missing, self._engines(isvc.ref)
        unserved = None
        if isvc.routing.enabled and not self._children.served(_POOL):
            # Nothing of the routing is applied (a picker without its pool would only crash);
            # retried, so installing the CRD is all it takes.
            unserved = Problem("InferencePoolCRDMissing", _NO_POOL_CRD, retry=True)
        else:
            wanted.update(routing(isvc, self._config))
        problem, ours = self._apply(isvc, wanted)
        return problem or unserved, ours

    def _apply(self, isvc: InferenceService, wanted: Wanted) -> tuple[Problem | None, Ours]:
        namespace, uid = isvc.ref.namespace, isvc.ref.uid
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
                if key.kind == _KEDA and err.status == 404:
                    message = f"KEDA is not installed (the API server has no {_KEDA.api_version})"
                return Problem("ApplyFailed", f"{key.kind} {key.name}: {message}"), ours
        return None, ours

    def _engines(self, ref: ObjectRef) -> Ours:
        """The engine's Deployment and LeaderWorkerSet, those that exist and are ours: what the
        status reports when nothing could be applied."""
        keys = [ChildKey(Kind.DEPLOYMENT, ref.name), ChildKey(_LWS, ref.name)]
        found = {key: self._children.read(key.kind, ref.namespace, key.name) for key in keys}
        return {key: obj for key, obj in found.items() if obj and controller_uid(obj) == ref.uid}
