"""Pure: what the reconciler saw -> the InferenceService's ``status``.

Only the operator writes ``status`` (a merge patch on the status subresource). Conditions:

- ``Ready``: True while at least one replica is ready, i.e. the Service has an endpoint.
- ``Progressing``: True while the Deployment rolls out the current spec; False once it has, or
  when the spec could not be applied (reason says why).
- ``Degraded``: True with a reason when something needs a person: a spec the operator cannot
  apply (a missing Secret, an object the API server refused) or replicas that cannot start
  (unschedulable, image pull or crash loops, a stuck rollout).

``observedGeneration`` is the generation the operator last reconciled, whatever the outcome: the
conditions tell whether that generation was applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Container waiting reasons that mean the replica will not start without someone acting.
STUCK_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


@dataclass(frozen=True)
class Problem:
    """Why the spec was not (fully) applied. ``retry``: a later attempt can succeed without a
    spec change (a Secret may appear), so the handler should be retried."""

    reason: str
    message: str
    retry: bool = False


@dataclass(frozen=True)
class Observation:
    generation: int
    url: str
    selector: str
    problem: Problem | None
    deployment: Mapping[str, Any] | None  # API JSON, None when it does not exist
    pods: Sequence[Mapping[str, Any]]  # API JSON of the Deployment's pods (listed when unready)


def _condition_of(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    conditions = obj.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


def _deployment_problem(deployment: Mapping[str, Any]) -> Problem | None:
    failure = _condition_of(deployment, "ReplicaFailure")
    if failure.get("status") == "True":
        return Problem("ReplicaFailure", failure.get("message", ""))
    progressing = _condition_of(deployment, "Progressing")
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        return Problem("ProgressDeadlineExceeded", progressing.get("message", ""))
    return None


def _pod_problem(pods: Sequence[Mapping[str, Any]]) -> Problem | None:
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = pod["metadata"]["name"]
        scheduled = _condition_of(pod, "PodScheduled")
        if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
            return Problem("Unschedulable", f"pod {name}: {scheduled.get('message', '')}")
        status = pod.get("status", {})
        containers = [
            *status.get("initContainerStatuses", []),
            *status.get("containerStatuses", []),
        ]
        for container in containers:
            waiting = container.get("state", {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in STUCK_WAITING_REASONS:
                detail = waiting.get("message") or reason
                return Problem(reason, f"pod {name}, container {container['name']}: {detail}")
    return None


def _conditions(obs: Observation) -> list[tuple[str, bool, str, str]]:
    """(type, status, reason, message) of Ready, Progressing, Degraded."""
    degraded = obs.problem
    deployment = obs.deployment
    if deployment is None:
        why = degraded or Problem("DeploymentNotFound", "the engine Deployment does not exist")
        return [
            ("Ready", False, why.reason, why.message),
            ("Progressing", False, why.reason, why.message),
            ("Degraded", degraded is not None, why.reason, why.message),
        ]
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    desired = spec.get("replicas", 1)
    ready = status.get("readyReplicas", 0)
    updated = status.get("updatedReplicas", 0)
    available = status.get("availableReplicas", 0)
    degraded = degraded or _deployment_problem(deployment) or _pod_problem(obs.pods)

    if ready:
        ready_condition = ("Ready", True, "ReplicasReady", f"{ready}/{desired} replicas ready")
    elif desired == 0:
        ready_condition = ("Ready", False, "ScaledToZero", "the Deployment has 0 replicas")
    else:
        ready_condition = ("Ready", False, "NoReplicaReady", f"0/{desired} replicas ready")

    if obs.problem is not None:
        progressing = ("Progressing", False, obs.problem.reason, obs.problem.message)
    elif (
        status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
        and status.get("replicas", 0) == updated == available == desired
    ):
        progressing = (
            "Progressing",
            False,
            "RolloutComplete",
            f"{desired}/{desired} replicas up to date",
        )
    else:
        message = f"{updated}/{desired} replicas updated, {ready}/{status.get('replicas', 0)} ready"
        progressing = ("Progressing", True, "RollingOut", message)

    if degraded is None:
        degraded_condition = ("Degraded", False, "AsExpected", "")
    else:
        degraded_condition = ("Degraded", True, degraded.reason, degraded.message)
    return [ready_condition, progressing, degraded_condition]


def build_status(obs: Observation, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The whole ``status``; ``lastTransitionTime`` moves (to ``now``) only when a condition's
    status flips, so an unchanged world yields a status equal to ``previous``."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    conditions = []
    for kind, ok, reason, message in _conditions(obs):
        value = "True" if ok else "False"
        old = before.get(kind, {})
        since = old.get("lastTransitionTime", now) if old.get("status") == value else now
        conditions.append(
            {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message,
                "observedGeneration": obs.generation,
                "lastTransitionTime": since,
            }
        )
    deployment_status = (obs.deployment or {}).get("status", {})
    return {
        "observedGeneration": obs.generation,
        "replicas": deployment_status.get("replicas", 0),
        "readyReplicas": deployment_status.get("readyReplicas", 0),
        "url": obs.url,
        "selector": obs.selector,
        "conditions": conditions,
    }
