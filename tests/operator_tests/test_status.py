"""Unit tests of status.build_status: conditions from what the reconciler saw, exact values."""

from __future__ import annotations

from typing import Any

from quire_operator.status import Observation, Problem, build_status

URL = "http://llm.ml.svc.cluster.local:8000"
SELECTOR = "app.kubernetes.io/instance=llm,app.kubernetes.io/name=quire-engine"
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def deployment(desired: int, generation: int = 1, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "llm", "generation": generation},
        "spec": {"replicas": desired},
        "status": {"observedGeneration": generation, **status},
    }


def observe(
    deployment: dict[str, Any] | None,
    problem: Problem | None = None,
    pods: list[dict[str, Any]] | None = None,
) -> Observation:
    return Observation(3, URL, SELECTOR, problem, deployment, pods or [])


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def test_rolled_out_and_ready() -> None:
    done = deployment(2, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    status = build_status(observe(done), {}, T0)
    assert status == {
        "observedGeneration": 3,
        "replicas": 2,
        "readyReplicas": 2,
        "url": URL,
        "selector": SELECTOR,
        "conditions": [
            {
                "type": kind,
                "status": value,
                "reason": reason,
                "message": message,
                "observedGeneration": 3,
                "lastTransitionTime": T0,
            }
            for kind, value, reason, message in [
                ("Ready", "True", "ReplicasReady", "2/2 replicas ready"),
                ("Progressing", "False", "RolloutComplete", "2/2 replicas up to date"),
                ("Degraded", "False", "AsExpected", ""),
            ]
        ],
    }
    # Nothing changed: the same status, transition times kept, so no write happens.
    assert build_status(observe(done), status, T1) == status


def test_transition_time_moves_only_with_the_status() -> None:
    rolling = deployment(2, replicas=2, readyReplicas=1, updatedReplicas=2, availableReplicas=1)
    before = build_status(observe(rolling), {}, T0)
    done = deployment(2, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    after = build_status(observe(done), before, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in after["conditions"]}
    assert times == {"Ready": T0, "Progressing": T1, "Degraded": T0}
    assert conditions(before)["Progressing"] == (
        "True",
        "RollingOut",
        "2/2 replicas updated, 1/2 ready",
    )


def test_missing_secret_before_any_deployment() -> None:
    missing = Problem("SecretNotFound", 'Secret "hf" not found', retry=True)
    status = build_status(observe(None, missing), {}, T0)
    why = ("SecretNotFound", 'Secret "hf" not found')
    assert conditions(status) == {
        "Ready": ("False", *why),
        "Progressing": ("False", *why),
        "Degraded": ("True", *why),
    }
    assert (status["replicas"], status["readyReplicas"]) == (0, 0)


def test_problem_with_a_running_deployment_keeps_it_ready() -> None:
    # A later spec named a missing Secret: the old replicas still serve, and the status says both.
    serving = deployment(1, replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1)
    refused = Problem("ApplyFailed", "Deployment llm: invalid value")
    assert conditions(build_status(observe(serving, refused), {}, T0)) == {
        "Ready": ("True", "ReplicasReady", "1/1 replicas ready"),
        "Progressing": ("False", "ApplyFailed", "Deployment llm: invalid value"),
        "Degraded": ("True", "ApplyFailed", "Deployment llm: invalid value"),
    }


def pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def test_unschedulable_pod_degrades_with_the_schedulers_words() -> None:
    message = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    unscheduled = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
    }
    pending = deployment(1, replicas=1, updatedReplicas=1, unavailableReplicas=1)
    status = build_status(observe(pending, pods=[pod("llm-b", conditions=[unscheduled])]), {}, T0)
    assert conditions(status)["Degraded"] == ("True", "Unschedulable", f"pod llm-b: {message}")
    assert conditions(status)["Ready"] == ("False", "NoReplicaReady", "0/1 replicas ready")


def test_crash_loop_in_an_init_container_degrades() -> None:
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}
    init = {"name": "download-model", "state": {"waiting": waiting}}
    pending = deployment(1, replicas=1, updatedReplicas=1)
    status = build_status(
        observe(pending, pods=[pod("llm-a", initContainerStatuses=[init])]), {}, T0
    )
    assert conditions(status)["Degraded"] == (
        "True",
        "CrashLoopBackOff",
        "pod llm-a, container download-model: back-off 40s restarting failed container",
    )


def test_stuck_rollout_and_replica_failure_come_from_the_deployment() -> None:
    stuck = deployment(1, replicas=2, readyReplicas=1, updatedReplicas=1, availableReplicas=1)
    stuck["status"]["conditions"] = [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "llm-7d" has timed out progressing.'},
    ]  # fmt: skip
    assert conditions(build_status(observe(stuck), {}, T0))["Degraded"] == (
        "True",
        "ProgressDeadlineExceeded",
        'ReplicaSet "llm-7d" has timed out progressing.',
    )
    quota = deployment(1, replicas=0)
    quota["status"]["conditions"] = [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
         "message": "pods is forbidden: exceeded quota"},
    ]  # fmt: skip
    assert conditions(build_status(observe(quota), {}, T0))["Degraded"] == (
        "True",
        "ReplicaFailure",
        "pods is forbidden: exceeded quota",
    )


def test_scaled_to_zero_is_not_ready_but_not_degraded() -> None:
    parked = deployment(0)
    assert conditions(build_status(observe(parked), {}, T0)) == {
        "Ready": ("False", "ScaledToZero", "the Deployment has 0 replicas"),
        "Progressing": ("False", "RolloutComplete", "0/0 replicas up to date"),
        "Degraded": ("False", "AsExpected", ""),
    }
