"""kopf handlers: thin, typed, and all ending in ``Requeue.run(namespace, name)`` (a reconcile
that is retried with backoff until it succeeds, see requeue.py).

Triggers:
- The InferenceService is created, changed (spec, labels, annotations) or found at operator
  start (resume). A failure or a problem a later attempt can fix (an object in the way that is
  not ours) is retried by the requeue, not by kopf, so every trigger gets the same backoff and
  the Degraded condition clears by itself once the cause is gone.
- A child (Deployment, Service, HPA, PDB, ScaledObject, InferencePool, the model cache's claim
  and Job) or a pod (engine, Endpoint Picker, model download) changes or is deleted: every kind
  of kinds.py whose ``Watch`` is not ``NOT_WATCHED``, each with the change rule it names there.
  Those watch streams carry only objects labelled ``app.kubernetes.io/managed-by=quire-operator``
  (a server-side label selector), and the owning InferenceService is named by the
  ``app.kubernetes.io/instance`` label. Kinds with an optional CRD (InferencePools, KEDA
  ScaledObjects) are watched only when their CRD is served at start (``served``); the Endpoint
  Picker's ConfigMap, ServiceAccount, Role and RoleBinding are not watched (the operator may
  not list ConfigMaps, and needs no watch on RBAC objects): a change to them is repaired on the
  next reconcile. This is how drift is repaired within seconds and how status follows the
  Deployment and its pods without any timer (kopf timers would put a finalizer on every
  InferenceService, and deletion should rely on owner references alone).
- The requeue's slow periodic resync, for whatever no event announced.

There is no deletion handler: the garbage collector deletes the children through their owner
references. Peering (see cli.py) keeps all but one operator process paused.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any

import kopf

from quire_operator import meta
from quire_operator.kinds import RESOURCES, Kind, Watch

# Reconcile one InferenceService, retrying on failure (Requeue.run).
Run = Callable[[str, str], None]


def _generation(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"].get("generation"))


def _verdicts(obj: Mapping[str, Any]) -> str:
    """An object's conditions as ``type=status/reason``, sorted: no timestamps or messages."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    found = (f"{c.get('type')}={c.get('status')}/{c.get('reason')}" for c in conditions)
    return ",".join(sorted(found))


def _hpa_state(obj: Mapping[str, Any]) -> str:
    """An HPA's spec generation, replica choice and condition verdicts: what status.autoscaler
    shows, without the timestamps and metric values it rewrites every sync."""
    desired = (obj.get("status") or {}).get("desiredReplicas")
    return f"{_generation(obj)};{desired};{_verdicts(obj)}"


def _scaled_object_state(obj: Mapping[str, Any]) -> str:
    """A ScaledObject's spec generation and condition verdicts (Ready, Active, Fallback): what
    status.autoscaler shows, without KEDA's per-poll writes (lastActiveTime)."""
    return f"{_generation(obj)};{_verdicts(obj)}"


def _job_state(obj: Mapping[str, Any]) -> str:
    """A Job's running and failed pod counts and its condition verdicts (Complete, Failed): what
    status.modelCache shows."""
    status = obj.get("status") or {}
    return f"{status.get('active', 0)};{status.get('failed', 0)};{_verdicts(obj)}"


def _resource_version(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"].get("resourceVersion"))


ChangedWhen = Callable[[Mapping[str, Any]], str]
# Each watch rule of kinds.py: the part of the object whose change calls for a reconcile; None
# means every event matters (Deployment and pod status feed the InferenceService's).
CHANGED_WHEN: Mapping[Watch, ChangedWhen | None] = MappingProxyType(
    {
        Watch.EVERY_EVENT: None,
        Watch.RESOURCE_VERSION: _resource_version,
        Watch.GENERATION: _generation,
        Watch.HPA_STATE: _hpa_state,
        Watch.SCALED_OBJECT_STATE: _scaled_object_state,
        Watch.JOB_STATE: _job_state,
    }
)
_WATCHED = tuple(kind for kind in Kind if RESOURCES[kind].watch is not Watch.NOT_WATCHED)
# Watched wherever the operator runs.
CHILDREN = tuple(kind for kind in _WATCHED if not RESOURCES[kind].optional_crd)
# Watched only where their CRD is served at start (the operator runs without them).
OPTIONAL_CHILDREN = tuple(kind for kind in _WATCHED if RESOURCES[kind].optional_crd)
POOLS = Kind.INFERENCE_POOL
SCALED_OBJECTS = Kind.SCALED_OBJECT


class ChildEvents:
    """Routes a child's events to its InferenceService's reconcile.

    Remembers, per child uid, the value of ``changed_when`` last seen. The first sighting only
    records it (the InferenceService's own create/resume handler covers that moment), later
    different values and deletions reconcile. kopf hands one object's events to one worker at a
    time, so each uid's entry has a single writer.
    """

    def __init__(self, run: Run) -> None:
        self._run = run
        self._seen: dict[str, str] = {}

    def handle(self, child: Kind, event: kopf.RawEvent) -> None:
        obj = event["object"]
        metadata = obj.get("metadata", {})
        owner = (metadata.get("labels") or {}).get(meta.INSTANCE_LABEL)
        namespace = metadata.get("namespace")
        if not owner or not namespace:
            return
        changed_when = CHANGED_WHEN[child.resource.watch]
        if changed_when is not None and not self._changed(changed_when, event):
            return
        self._run(namespace, owner)

    def _changed(self, changed_when: ChangedWhen, event: Any) -> bool:
        uid = event["object"]["metadata"]["uid"]
        if event.get("type") == "DELETED":
            self._seen.pop(uid, None)
            return True
        before = self._seen.get(uid)
        now = self._seen[uid] = changed_when(event["object"])
        return before is not None and before != now


def register(
    registry: kopf.OperatorRegistry,
    settings: kopf.OperatorSettings,
    run: Run,
    served: Collection[Kind] = (),
) -> None:
    """Register every handler in ``registry`` and narrow the children's watch streams;
    ``served``: the kinds with an optional CRD that the API server serves (kopf resolves
    resources once, at start: a watch on a kind that is not served would never deliver)."""
    inference_services = (meta.GROUP, meta.VERSION, meta.PLURAL)

    @kopf.on.resume(*inference_services, id="reconcile", registry=registry)
    @kopf.on.create(*inference_services, id="reconcile", registry=registry)
    @kopf.on.update(*inference_services, id="reconcile", registry=registry)
    def reconcile_inference_service(name: str, namespace: str | None, **_: Any) -> None:
        if namespace is None:  # kopf's signature allows it; the CRD is namespaced
            raise kopf.PermanentError("an InferenceService must have a namespace")
        run(namespace, name)

    events = ChildEvents(run)
    managed = {meta.MANAGED_BY_LABEL: meta.FIELD_MANAGER}
    for child in (*CHILDREN, *(child for child in OPTIONAL_CHILDREN if child in served)):
        selector = (child.group, child.version, child.plural)
        settings.watching.label_selectors[selector] = meta.MANAGED_BY_SELECTOR
        kopf.on.event(*selector, id=f"child-{child.plural}", labels=managed, registry=registry)(
            _child_handler(events, child)
        )


def _child_handler(events: ChildEvents, child: Kind) -> Callable[..., None]:
    def on_child_event(event: kopf.RawEvent, **_: Any) -> None:
        events.handle(child, event)

    return on_child_event
