"""Pure: what the reconciler saw -> the InferenceService's ``status``.

Only the operator writes ``status`` (a merge patch on the status subresource). Conditions:

- ``Ready``: True while at least one replica is ready, i.e. the Service has an endpoint.
- ``Progressing``: True while the Deployment rolls out the current spec; False once it has, or
  when the spec could not be applied (reason says why).
- ``Degraded``: True with a reason when something needs a person: a spec the operator cannot
  apply (an object of the same name it does not own, an object the API server refused) or
  replicas that cannot start (unschedulable, image pull or crash loops, a missing Secret, a
  stuck rollout).

- ``RoutingReady`` (only with ``spec.routing.mode: InferencePool``): True while the Endpoint
  Picker has a ready replica, its InferencePool exists and no Gateway reporting on the pool
  refuses it (``Accepted`` or ``ResolvedRefs`` False); otherwise False with the reason.
  ``status.routing`` names the pool and copies what each Gateway reports on it.

- ``ScaledToZero`` (only with ``spec.autoscaling.minReplicas: 0``): True while the Deployment
  has 0 replicas (the Endpoint Picker holds new requests until one is ready); False with reason
  ``Waking`` (and how many requests are held, from Prometheus) while replicas are wanted and none
  is ready yet, ``Scaled`` once one is.

``autoscaler`` is the state of the HPA or ScaledObject the operator owns: its replica counts (an
HPA's) and its conditions (an HPA's AbleToScale/ScalingActive/ScalingLimited, a ScaledObject's
Ready/Active/Fallback), which say whether scaling works and what limits it, and ``lastScale``:
when the Deployment's replica count last changed, from what to what, ``Up`` or ``Down``.

``modelCache`` (only with ``spec.model.cache``) follows the cache volume and its download Job:
``Pending`` (the claim is not bound or the Job has not started), ``Downloading``, ``Ready``
(the commit, bytes and files the Job verified) or ``Failed``; a failed Job (or one whose pod
cannot start) is also ``Degraded`` with reason ``ModelCacheFailed`` and the Job's last message.

``adapters`` and the ``AdaptersReady`` condition (only with ``spec.lora``): status/adapters.py.

``auth`` says what a client must send: ``APIKey`` (a bearer key from spec.apiKeySecretRef) or
``None``; a printer column shows it.

``observedGeneration`` is the generation the operator last reconciled, whatever the outcome: the
conditions tell whether that generation was applied.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from quire_operator.observed.views import (
    AutoscalerView,
    DeploymentView,
    DownloadOutcome,
    JobView,
    PodView,
    PoolParent,
)
from quire_operator.status.adapters import (
    AdapterObservation,
    adapters_condition,
    adapters_status,
)

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
# An InferencePool parent's conditions that, False, mean the Gateway does not route to the pool.
REFUSING_CONDITIONS = frozenset({"Accepted", "ResolvedRefs"})
# status.auth: what a client must send. A printer column shows it.
AUTH_API_KEY = "APIKey"
AUTH_NONE = "None"


class ConditionRow(NamedTuple):
    """One condition before its timestamps."""

    type: str
    ok: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Problem:
    """Why the spec was not (fully) applied. ``retry``: a later attempt can succeed without a
    spec change (an object in the way may go), so the reconcile should be retried."""

    reason: str
    message: str
    retry: bool = False


@dataclass(frozen=True)
class RoutingObservation:
    """The InferencePool and its Endpoint Picker, when the spec asks for them."""

    pool: str  # the InferencePool's name
    endpoint_picker: str  # its Service's name
    picker: DeploymentView | None  # None when it does not exist (or is not ours)
    picker_pods: Sequence[PodView]  # listed only when the picker is not settled
    parents: Sequence[PoolParent] | None  # None when the pool does not exist (or is not ours)


class CacheState(enum.Enum):
    PENDING = "Pending"
    DOWNLOADING = "Downloading"
    READY = "Ready"
    FAILED = "Failed"


@dataclass(frozen=True)
class CacheObservation:
    """The model cache's claim and download Job, when the spec asks for them."""

    claim: str
    claim_phase: str | None  # the claim's status.phase; None when it does not exist (or not ours)
    job: str  # the Job's name for the current spec
    download: JobView | None  # None when it does not exist (or is not ours)
    pods: Sequence[PodView] = ()  # the Job's pods
    outcome: DownloadOutcome | None = None  # the last finished pod's termination message


@dataclass(frozen=True)
class HostTierObservation:
    """The KV host tier as the spec sizes it (spec.engine.kvOffloadingSizeGiB > 0)."""

    size_gib: float
    memory_per_pod: str  # the quantity added to each engine pod's memory request (and limit)
    # The cache_config_info label the Endpoint Picker sizes its per-replica prefix index by;
    # None without routing.
    picker_capacity_label: str | None
    # Set when spec.resources.limits.memory is below the tier's share: likely meant for the
    # whole pod, while the operator adds the tier on top of it.
    warning: str | None = None


@dataclass(frozen=True)
class Observation:
    generation: int
    url: str
    selector: str
    api_key: bool  # the endpoint requires an API key (spec.apiKeySecretRef)
    problem: Problem | None
    deployment: DeploymentView | None  # None when it does not exist (or is not ours)
    pods: Sequence[PodView]  # the Deployment's pods (listed only when it is not settled)
    routing: RoutingObservation | None = None  # None with spec.routing.mode Service
    autoscaler: AutoscalerView | None = None  # None when autoscaling is off (or not applied)
    scales_to_zero: bool = False  # spec.autoscaling is on with minReplicas 0
    # Requests the Endpoint Picker holds while the service wakes from zero (None: not waking,
    # or Prometheus did not say).
    held: int | None = None
    model_cache: CacheObservation | None = None  # None without spec.model.cache
    host_tier: HostTierObservation | None = None  # None without a host tier (or invalid spec)
    # Each adapter of spec.lora (None without spec.lora, or for an invalid spec).
    adapters: Sequence[AdapterObservation] | None = None


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


def _picker_problem(routing: RoutingObservation | None) -> Problem | None:
    """A stuck Endpoint Picker (its image cannot be pulled, it crash-loops), worded as such."""
    if routing is None or routing.picker is None:
        return None
    stuck = _deployment_problem(routing.picker) or _pod_problem(routing.picker_pods)
    return None if stuck is None else Problem(stuck.reason, f"endpoint picker: {stuck.message}")


def _cache_state(cache: CacheObservation) -> tuple[CacheState, str]:
    job, outcome = cache.download, cache.outcome
    if job is None:
        return CacheState.PENDING, f"the download Job {cache.job} does not exist yet"
    if job.finished("Complete") is not None:
        return CacheState.READY, "downloaded and verified"
    failed = job.finished("Failed")
    if failed is not None:
        last = f"; last attempt: {outcome.error}" if outcome and outcome.error else ""
        return CacheState.FAILED, f"{failed.reason}: {failed.message}{last}"
    stuck = _pod_problem(cache.pods)
    if stuck is not None:
        return CacheState.PENDING, stuck.message
    if cache.claim_phase != "Bound":
        phase = cache.claim_phase or "missing"
        return CacheState.PENDING, f"PersistentVolumeClaim {cache.claim} is {phase}"
    if job.active:
        retry = f" (after {job.failed} failed attempts)" if job.failed else ""
        return CacheState.DOWNLOADING, f"Job {job.name} is downloading{retry}"
    return CacheState.PENDING, f"Job {job.name} has no running pod yet"


def _cache_problem(cache: CacheObservation | None) -> Problem | None:
    """A failed download Job, or one whose pod cannot start, needs a person."""
    if cache is None or cache.download is None:
        return None
    state, message = _cache_state(cache)
    if state is CacheState.FAILED or _pod_problem(cache.pods) is not None:
        return Problem("ModelCacheFailed", f"model cache Job {cache.job}: {message}")
    return None


def _cache_status(cache: CacheObservation) -> dict[str, Any]:
    state, message = _cache_state(cache)
    status: dict[str, Any] = {"state": state.value, "claim": cache.claim, "job": cache.job}
    outcome = cache.outcome
    if state is CacheState.READY and outcome is not None and outcome.succeeded:
        for key, value in (("commit", outcome.commit), ("bytes", outcome.bytes),
                           ("files", outcome.files)):  # fmt: skip
            if value is not None:
                status[key] = value
    status["message"] = message
    return status


def _routing_condition(obs: Observation, routing: RoutingObservation) -> ConditionRow:
    picker, parents = routing.picker, routing.parents
    if picker is None or parents is None:
        missing = "endpoint picker Deployment" if picker is None else "InferencePool"
        why = obs.problem or Problem("RoutingNotApplied", f"the {missing} does not exist")
        return ConditionRow("RoutingReady", False, why.reason, why.message)
    if not picker.ready:
        message = f"0/{picker.desired} endpoint picker replicas ready"
        stuck = _picker_problem(routing)
        if stuck is not None:
            message = f"{message}; {stuck.message}"
        return ConditionRow("RoutingReady", False, "EndpointPickerNotReady", message)
    for parent in parents:
        for kind, condition in parent.conditions:
            if kind in REFUSING_CONDITIONS and condition.status == "False":
                message = f"{parent.describe()}: {kind}=False: {condition.message}"
                return ConditionRow(
                    "RoutingReady", False, condition.reason or f"Not{kind}", message
                )
    named = ", ".join(parent.describe() for parent in parents)
    reports = f"reported by {named}" if parents else "no Gateway reports on the pool yet"
    message = f"endpoint picker ready, InferencePool {routing.pool}: {reports}"
    return ConditionRow("RoutingReady", True, "EndpointPickerReady", message)


def _conditions(obs: Observation) -> list[ConditionRow]:
    """Ready, Progressing, Degraded and, with routing, RoutingReady; with adapters,
    AdaptersReady."""
    # The conditions present only with their spec section.
    optional = [] if obs.routing is None else [_routing_condition(obs, obs.routing)]
    if obs.adapters:
        optional.append(ConditionRow("AdaptersReady", *adapters_condition(obs.adapters)))
    degraded = obs.problem
    deployment = obs.deployment
    if deployment is None:
        why = degraded or Problem("DeploymentNotFound", "the engine Deployment does not exist")
        return [
            ConditionRow("Ready", False, why.reason, why.message),
            ConditionRow("Progressing", False, why.reason, why.message),
            ConditionRow("Degraded", degraded is not None, why.reason, why.message),
            *optional,
        ]
    desired, ready = deployment.desired, deployment.ready
    degraded = (
        degraded
        or _deployment_problem(deployment)
        or _pod_problem(obs.pods)
        or _picker_problem(obs.routing)
        or _cache_problem(obs.model_cache)
    )

    if ready:
        ready_condition = ConditionRow(
            "Ready", True, "ReplicasReady", f"{ready}/{desired} replicas ready"
        )
    elif desired == 0:
        ready_condition = ConditionRow(
            "Ready", False, "ScaledToZero", "the Deployment has 0 replicas"
        )
    else:
        ready_condition = ConditionRow(
            "Ready", False, "NoReplicaReady", f"0/{desired} replicas ready"
        )

    if obs.problem is not None:
        progressing = ConditionRow("Progressing", False, obs.problem.reason, obs.problem.message)
    elif deployment.rolled_out:
        message = f"{desired}/{desired} replicas up to date"
        progressing = ConditionRow("Progressing", False, "RolloutComplete", message)
    else:
        updated, running = deployment.updated, deployment.replicas
        message = f"{updated}/{desired} replicas updated, {ready}/{running} ready"
        progressing = ConditionRow("Progressing", True, "RollingOut", message)

    if degraded is None:
        degraded_condition = ConditionRow("Degraded", False, "AsExpected", "")
    else:
        degraded_condition = ConditionRow("Degraded", True, degraded.reason, degraded.message)
    zero = []
    if obs.scales_to_zero:
        zero = [_zero_condition(desired, ready, obs.held)]
    return [ready_condition, progressing, degraded_condition, *optional, *zero]


def _routing_status(routing: RoutingObservation) -> dict[str, Any]:
    parents = [
        {
            "parentRef": {
                "group": parent.group,
                "kind": parent.kind,
                "namespace": parent.namespace,
                "name": parent.name,
            },
            "conditions": [
                {"type": kind, "status": c.status, "reason": c.reason, "message": c.message}
                for kind, c in parent.conditions
            ],
        }
        for parent in routing.parents or ()
    ]
    return {
        "inferencePool": routing.pool,
        "endpointPicker": routing.endpoint_picker,
        "parents": parents,
    }


def _zero_condition(desired: int, ready: int, held: int | None) -> ConditionRow:
    """True at zero; False ``Waking`` while replicas are wanted and none is ready yet (the
    picker holds the requests that woke it), False ``Scaled`` once one serves."""
    if desired == 0:
        return ConditionRow("ScaledToZero", True, "NoReplicas", "the Deployment has 0 replicas")
    if ready == 0:
        count = "requests" if held is None else f"{held} requests"
        message = f"waking: {desired} replicas starting, {count} held by the endpoint picker"
        return ConditionRow("ScaledToZero", False, "Waking", message)
    return ConditionRow("ScaledToZero", False, "Scaled", f"the Deployment has {desired} replicas")


def _last_scale(previous: Mapping[str, Any], desired: int, now: str) -> dict[str, Any] | None:
    """When the Deployment's replica count last changed, from what to what: moved (to ``now``)
    when ``desired`` differs from the count the previous status recorded."""
    before = previous.get("desiredReplicas")
    last: dict[str, Any] | None = (previous.get("autoscaler") or {}).get("lastScale")
    if before is None or int(before) == desired:
        return last
    direction = "Up" if desired > int(before) else "Down"
    return {"time": now, "from": int(before), "to": desired, "direction": direction}


def _autoscaler_status(autoscaler: AutoscalerView) -> dict[str, Any]:
    status: dict[str, Any] = {"kind": autoscaler.kind, "name": autoscaler.name}
    if autoscaler.current_replicas is not None:
        status["currentReplicas"] = autoscaler.current_replicas
    if autoscaler.desired_replicas is not None:
        status["desiredReplicas"] = autoscaler.desired_replicas
    status["conditions"] = [
        {"type": kind, "status": c.status, "reason": c.reason, "message": c.message}
        for kind, c in autoscaler.conditions
    ]
    return status


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
    status: dict[str, Any] = {
        "observedGeneration": obs.generation,
        "desiredReplicas": deployment.desired if deployment else 0,
        "replicas": deployment.replicas if deployment else 0,
        "readyReplicas": deployment.ready if deployment else 0,
        "url": obs.url,
        "auth": AUTH_API_KEY if obs.api_key else AUTH_NONE,
        "selector": obs.selector,
        "conditions": conditions,
    }
    if obs.routing is not None:
        status["routing"] = _routing_status(obs.routing)
    if obs.autoscaler is not None:
        status["autoscaler"] = _autoscaler_status(obs.autoscaler)
        last = _last_scale(previous, status["desiredReplicas"], now)
        if last is not None:
            status["autoscaler"]["lastScale"] = last
    if obs.model_cache is not None:
        status["modelCache"] = _cache_status(obs.model_cache)
    if obs.host_tier is not None:
        status["hostTier"] = _host_tier_status(obs.host_tier)
    if obs.adapters is not None:
        status["adapters"] = adapters_status(obs.adapters)
    return status


def _host_tier_status(tier: HostTierObservation) -> dict[str, Any]:
    status: dict[str, Any] = {"sizeGiB": tier.size_gib, "memoryPerPod": tier.memory_per_pod}
    if tier.picker_capacity_label is not None:
        status["pickerCapacityLabel"] = tier.picker_capacity_label
    if tier.warning is not None:
        status["warning"] = tier.warning
    return status
