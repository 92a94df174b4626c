"""Pure: what the reconciler saw -> the InferenceService's ``status``.

Only the operator writes ``status`` (a merge patch on the status subresource). Conditions:

- ``Ready``: True while at least one replica is ready, i.e. the Service has an endpoint.
- ``Progressing``: True while the Deployment rolls out the current spec; False once it has, or
  when the spec could not be applied (reason says why).
- ``Degraded``: True with a reason when something needs a person: a spec the operator cannot
  apply (an object of the same name it does not own, an object the API server refused) or
  replicas that cannot start (unschedulable, image pull or crash loops, a missing Secret, a
  stuck rollout).

``auth`` says what a client must send: ``APIKey`` (a bearer key from spec.apiKeySecretRef) or
``None``; a printer column shows it.

``observedGeneration`` is the generation the operator last reconciled, whatever the outcome: the
conditions tell whether that generation was applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from quire_operator.observed import DeploymentView, PodView

# Container waiting reasons that mean the replica will not start without someone acting.
# CreateContainerConfigError is also how a missing Secret (API key, model token) shows: the
# kubelet's message names it, and the replica starts by itself once the Secret exists.
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
# status.auth: what a client must send. A printer column shows it.
AUTH_API_KEY = "APIKey"
AUTH_NONE = "None"


@dataclass(frozen=True)
class Problem:
    """Why the spec was not (fully) applied. ``retry``: a later attempt can succeed without a
    spec change (an object in the way may go), so the reconcile should be retried."""

    reason: str
    message: str
    retry: bool = False


@dataclass(frozen=True)
class Observation:
    generation: int
    url: str
    selector: str
    api_key: bool  # the endpoint requires an API key (spec.apiKeySecretRef)
    problem: Problem | None
    deployment: DeploymentView | None  # None when it does not exist (or is not ours)
    pods: Sequence[PodView]  # the Deployment's pods (listed only when it is not settled)


def _deployment_problem(deployment: DeploymentView) -> Problem | None:
    failure = deployment.conditions.get("ReplicaFailure")
    if failure is not None and failure.status == "True":
        return Problem("ReplicaFailure", failure.message)
    progressing = deployment.conditions.get("Progressing")
    if progressing is not None and progressing.reason == "ProgressDeadlineExceeded":
        return Problem("ProgressDeadlineExceeded", progressing.message)
    return None


def _pod_problem(pods: Sequence[PodView]) -> Problem | None:
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.unschedulable is not None:
            return Problem("Unschedulable", f"pod {pod.name}: {pod.unschedulable}")
        for waiting in pod.waiting:
            if waiting.reason in STUCK_WAITING_REASONS:
                where = f"pod {pod.name}, container {waiting.container}"
                return Problem(waiting.reason, f"{where}: {waiting.message}")
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
    desired, ready = deployment.desired, deployment.ready
    degraded = degraded or _deployment_problem(deployment) or _pod_problem(obs.pods)

    if ready:
        ready_condition = ("Ready", True, "ReplicasReady", f"{ready}/{desired} replicas ready")
    elif desired == 0:
        ready_condition = ("Ready", False, "ScaledToZero", "the Deployment has 0 replicas")
    else:
        ready_condition = ("Ready", False, "NoReplicaReady", f"0/{desired} replicas ready")

    if obs.problem is not None:
        progressing = ("Progressing", False, obs.problem.reason, obs.problem.message)
    elif deployment.rolled_out:
        message = f"{desired}/{desired} replicas up to date"
        progressing = ("Progressing", False, "RolloutComplete", message)
    else:
        updated, running = deployment.updated, deployment.replicas
        message = f"{updated}/{desired} replicas updated, {ready}/{running} ready"
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
    deployment = obs.deployment
    return {
        "observedGeneration": obs.generation,
        "desiredReplicas": deployment.desired if deployment else 0,
        "replicas": deployment.replicas if deployment else 0,
        "readyReplicas": deployment.ready if deployment else 0,
        "url": obs.url,
        "auth": AUTH_API_KEY if obs.api_key else AUTH_NONE,
        "selector": obs.selector,
        "conditions": conditions,
    }
