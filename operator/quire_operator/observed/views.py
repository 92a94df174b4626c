"""What the operator observes, parsed once: frozen views of a Deployment, its pods, the
parents (Gateways) reporting on an InferencePool, the model cache's download Job and its pods'
termination messages.

The API server's JSON (``sanitize_for_serialization`` of the client's models) is walked here and
nowhere else, the way ``spec/parsing.py`` is the only reader of the custom object. A missing
field takes the value the API server means by its absence (``spec.replicas`` 1, counters 0), so
``status/conditions.py`` works on plain typed values and its tests build views from small
literals.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quire_operator.builders.leader_worker_set import LEADER_INDEX, WORKER_INDEX_LABEL


@dataclass(frozen=True)
class Condition:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


def _condition(c: Mapping[str, Any]) -> Condition:
    return Condition(c.get("status", "Unknown"), c.get("reason", ""), c.get("message", ""))


def _conditions(status: Mapping[str, Any]) -> dict[str, Condition]:
    return {c["type"]: _condition(c) for c in status.get("conditions") or [] if "type" in c}


@dataclass(frozen=True)
class DeploymentView:
    """An apps/v1 Deployment: desired replicas and the controller's counters and conditions."""

    generation: int
    desired: int  # spec.replicas
    observed_generation: int  # status.observedGeneration: the spec the controller has seen
    replicas: int  # pods of any template
    updated: int  # pods of the current template
    ready: int
    available: int
    conditions: Mapping[str, Condition]

    @property
    def settled(self) -> bool:
        """Every replica runs the current template and is ready (nothing left to explain)."""
        return self.replicas == self.updated == self.ready == self.desired

    @property
    def rolled_out(self) -> bool:
        """The controller has seen the current spec and every replica is updated and available."""
        seen = self.observed_generation >= self.generation
        return seen and self.replicas == self.updated == self.available == self.desired


def parse_deployment(obj: Mapping[str, Any]) -> DeploymentView:
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    return DeploymentView(
        generation=int(obj.get("metadata", {}).get("generation", 0)),
        desired=int(spec.get("replicas", 1)),
        observed_generation=int(status.get("observedGeneration", 0)),
        replicas=int(status.get("replicas", 0)),
        updated=int(status.get("updatedReplicas", 0)),
        ready=int(status.get("readyReplicas", 0)),
        available=int(status.get("availableReplicas", 0)),
        conditions=_conditions(status),
    )


def parse_leader_worker_set(obj: Mapping[str, Any]) -> DeploymentView:
    """A LeaderWorkerSet as the Deployment view of its groups: its status has the Deployment's
    counters (``replicas`` counts groups) but no available count; a group is available when it
    is ready (all its pods are)."""
    view = parse_deployment(obj)
    return dataclasses.replace(view, available=view.ready)


@dataclass(frozen=True)
class Waiting:
    """A container that is not running, and the kubelet's words for why."""

    container: str
    reason: str
    message: str


@dataclass(frozen=True)
class PodView:
    name: str
    # The scheduler's message while it cannot place the pod (PodScheduled=False, Unschedulable).
    unschedulable: str | None
    # Waiting containers, init containers first, in the order the kubelet lists them.
    waiting: tuple[Waiting, ...]


def parse_pod(obj: Mapping[str, Any]) -> PodView:
    status = obj.get("status") or {}
    scheduled = _conditions(status).get("PodScheduled")
    unschedulable = None
    if scheduled is not None and (scheduled.status, scheduled.reason) == ("False", "Unschedulable"):
        unschedulable = scheduled.message
    waiting = []
    for container in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        state = (container.get("state") or {}).get("waiting")
        if state is not None:
            reason = state.get("reason", "")
            waiting.append(Waiting(container["name"], reason, state.get("message") or reason))
    return PodView(obj["metadata"]["name"], unschedulable, tuple(waiting))


@dataclass(frozen=True)
class PoolParent:
    """One parent (a Gateway) reporting on an InferencePool: its entry of ``status.parents``."""

    group: str
    kind: str
    namespace: str  # "" for the pool's own namespace
    name: str
    # (type, condition) in the parent's order: Accepted, ResolvedRefs, ...
    conditions: tuple[tuple[str, Condition], ...]

    def describe(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {where}"


def parse_pool_parents(obj: Mapping[str, Any]) -> tuple[PoolParent, ...]:
    """An InferencePool's ``status.parents``; the CRD defaults a parentRef's group and kind to
    the Gateway API's Gateway."""
    parents = []
    for entry in (obj.get("status") or {}).get("parents") or []:
        ref = entry.get("parentRef") or {}
        conditions = tuple(
            (c["type"], _condition(c)) for c in entry.get("conditions") or [] if "type" in c
        )
        parents.append(
            PoolParent(
                group=ref.get("group", "gateway.networking.k8s.io"),
                kind=ref.get("kind", "Gateway"),
                namespace=ref.get("namespace", ""),
                name=ref.get("name", ""),
                conditions=conditions,
            )
        )
    return tuple(parents)


# The autoscaler conditions status.autoscaler copies: the HPA's (autoscaling/v2) and a KEDA
# ScaledObject's; others (KEDA's Paused) are left out.
AUTOSCALER_CONDITIONS = frozenset(
    {"AbleToScale", "ScalingActive", "ScalingLimited", "Ready", "Active", "Fallback"}
)


@dataclass(frozen=True)
class AutoscalerView:
    """The HPA or ScaledObject the operator owns: its kind, name, replica counts (an HPA's
    ``status.currentReplicas``/``desiredReplicas``; None for a ScaledObject, whose HPA KEDA owns)
    and conditions."""

    kind: str
    name: str
    current_replicas: int | None
    desired_replicas: int | None
    conditions: tuple[tuple[str, Condition], ...]


def parse_autoscaler(obj: Mapping[str, Any]) -> AutoscalerView:
    status = obj.get("status") or {}
    conditions = tuple(
        (c["type"], _condition(c))
        for c in status.get("conditions") or []
        if c.get("type") in AUTOSCALER_CONDITIONS
    )
    current, desired = status.get("currentReplicas"), status.get("desiredReplicas")
    return AutoscalerView(
        kind=obj.get("kind", ""),
        name=obj.get("metadata", {}).get("name", ""),
        current_replicas=None if current is None else int(current),
        desired_replicas=None if desired is None else int(desired),
        conditions=conditions,
    )


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (the owner reference with ``controller: true``)."""
    for owner in obj.get("metadata", {}).get("ownerReferences") or []:
        if owner.get("controller"):
            uid: str | None = owner.get("uid")
            return uid
    return None


@dataclass(frozen=True)
class JobView:
    """A batch/v1 Job: its pods' counters and its conditions (Complete, Failed)."""

    name: str
    active: int
    failed: int
    conditions: Mapping[str, Condition]

    def finished(self, kind: str) -> Condition | None:
        """The ``Complete`` or ``Failed`` condition when it is True."""
        condition = self.conditions.get(kind)
        return condition if condition is not None and condition.status == "True" else None


def parse_job(obj: Mapping[str, Any]) -> JobView:
    status = obj.get("status") or {}
    return JobView(
        name=obj.get("metadata", {}).get("name", ""),
        active=int(status.get("active", 0)),
        failed=int(status.get("failed", 0)),
        conditions=_conditions(status),
    )


@dataclass(frozen=True)
class DownloadOutcome:
    """The termination message of the model cache's download, from its last finished pod:
    ``quire_engine.hub_cache`` writes one JSON line (commit, bytes, files) on success and its
    error otherwise (or the kubelet its last log lines)."""

    succeeded: bool
    commit: str | None = None
    bytes: int | None = None
    files: int | None = None
    error: str = ""


def parse_download(pods: Sequence[Mapping[str, Any]]) -> DownloadOutcome | None:
    """The outcome of the newest pod whose container has terminated; None while none has."""
    ended = []
    for pod in pods:
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated")
            if terminated is not None:
                ended.append((terminated.get("finishedAt") or "", terminated))
    if not ended:
        return None
    _, last = max(ended, key=lambda item: item[0])
    message = (last.get("message") or "").strip()
    if last.get("exitCode") != 0:
        return DownloadOutcome(False, error=message or last.get("reason") or "failed")
    try:
        summary = json.loads(message)
        return DownloadOutcome(
            True, str(summary["commit"]), int(summary["bytes"]), int(summary["files"])
        )
    except (ValueError, KeyError, TypeError):
        return DownloadOutcome(True)  # finished, but said nothing readable


@dataclass(frozen=True)
class ServingPod:
    """An engine pod that serves HTTP and is Ready: the operator may call its API."""

    name: str
    ip: str


def parse_serving_pod(obj: Mapping[str, Any]) -> ServingPod | None:
    """The pod as a ``ServingPod``; None while it is not Ready, has no IP, is being deleted, or
    is a LeaderWorkerSet worker (its group's leader serves for it)."""
    metadata, status = obj.get("metadata") or {}, obj.get("status") or {}
    if metadata.get("deletionTimestamp") or not status.get("podIP"):
        return None
    # A LeaderWorkerSet pod's index in its group: the leader serves HTTP for the group.
    index = (metadata.get("labels") or {}).get(WORKER_INDEX_LABEL, LEADER_INDEX)
    if index != LEADER_INDEX:
        return None
    ready = _conditions(status).get("Ready")
    if ready is None or ready.status != "True":
        return None
    return ServingPod(metadata["name"], status["podIP"])
