"""What the operator observes, parsed once: frozen views of a Deployment and its pods.

The API server's JSON (``sanitize_for_serialization`` of the client's models) is walked here and
nowhere else, the way ``spec.py`` is the only reader of the custom object. A missing field takes
the value the API server means by its absence (``spec.replicas`` 1, counters 0), so ``status.py``
works on plain typed values and its tests build views from small literals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Condition:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


def _conditions(status: Mapping[str, Any]) -> dict[str, Condition]:
    return {
        c["type"]: Condition(c.get("status", "Unknown"), c.get("reason", ""), c.get("message", ""))
        for c in status.get("conditions") or []
        if "type" in c
    }


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


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (the owner reference with ``controller: true``)."""
    for owner in obj.get("metadata", {}).get("ownerReferences") or []:
        if owner.get("controller"):
            uid: str | None = owner.get("uid")
            return uid
    return None
