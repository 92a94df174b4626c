"""kopf handlers: thin, typed, and all ending in ``Requeue.run(namespace, name)`` (a reconcile
that is retried with backoff until it succeeds, see requeue.py).

Triggers:
- The InferenceService is created, changed (spec, labels, annotations) or found at operator
  start (resume). A failure or a problem a later attempt can fix (an object in the way that is
  not ours) is retried by the requeue, not by kopf, so every trigger gets the same backoff and
  the Degraded condition clears by itself once the cause is gone.
- A child (Deployment, Service, HPA, PDB) or an engine pod changes or is deleted. Those watch
  streams carry only objects labelled ``app.kubernetes.io/managed-by=quire-operator`` (a
  server-side label selector), and the owning InferenceService is named by the
  ``app.kubernetes.io/instance`` label. This is how drift is repaired within seconds and how
  status follows the Deployment and its pods without any timer (kopf timers would put a
  finalizer on every InferenceService, and deletion should rely on owner references alone).
- The requeue's slow periodic resync, for whatever no event announced.

There is no deletion handler: the garbage collector deletes the children through their owner
references. Peering (see cli.py) keeps all but one operator process paused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from quire_operator import meta

# Reconcile one InferenceService, retrying on failure (Requeue.run).
Run = Callable[[str, str], None]


def _generation(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"].get("generation"))


def _resource_version(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"].get("resourceVersion"))


@dataclass(frozen=True)
class Child:
    """A kind of object the operator makes (or, for pods, causes) and watches.

    ``changed_when``: the part of the object whose change calls for a reconcile (its spec's
    generation, say), so status-only churn (an HPA rewrites its status every sync) costs nothing;
    None means every event matters (Deployment and pod status feed the InferenceService's).
    """

    group: str
    version: str
    plural: str
    changed_when: Callable[[Mapping[str, Any]], str] | None


CHILDREN = (
    Child("apps", "v1", "deployments", None),
    Child("", "v1", "pods", None),
    # Services have no generation; their resourceVersion only moves when someone edits them.
    Child("", "v1", "services", _resource_version),
    Child("autoscaling", "v2", "horizontalpodautoscalers", _generation),
    Child("policy", "v1", "poddisruptionbudgets", _generation),
)


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

    def handle(self, child: Child, event: kopf.RawEvent) -> None:
        obj = event["object"]
        metadata = obj.get("metadata", {})
        owner = (metadata.get("labels") or {}).get(meta.INSTANCE_LABEL)
        namespace = metadata.get("namespace")
        if not owner or not namespace:
            return
        if child.changed_when is not None and not self._changed(child.changed_when, event):
            return
        self._run(namespace, owner)

    def _changed(self, changed_when: Callable[[Mapping[str, Any]], str], event: Any) -> bool:
        uid = event["object"]["metadata"]["uid"]
        if event.get("type") == "DELETED":
            self._seen.pop(uid, None)
            return True
        before = self._seen.get(uid)
        now = self._seen[uid] = changed_when(event["object"])
        return before is not None and before != now


def register(registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings, run: Run) -> None:
    """Register every handler in ``registry`` and narrow the children's watch streams."""
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
    for child in CHILDREN:
        selector = (child.group, child.version, child.plural)
        settings.watching.label_selectors[selector] = meta.MANAGED_BY_SELECTOR
        kopf.on.event(*selector, id=f"child-{child.plural}", labels=managed, registry=registry)(
            _child_handler(events, child)
        )


def _child_handler(events: ChildEvents, child: Child) -> Callable[..., None]:
    def on_child_event(event: kopf.RawEvent, **_: Any) -> None:
        events.handle(child, event)

    return on_child_event
