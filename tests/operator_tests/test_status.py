"""Unit tests of status.build_status and the observed views it reads: exact values.

The Deployments and pods are API JSON literals parsed by ``observed`` (the same functions the
reconciler uses), so these tests cover the parsing of what the API server sends as well.
"""

from __future__ import annotations

from typing import Any

from quire_operator.observed.views import (
    Condition,
    DeploymentView,
    PodView,
    Waiting,
    controller_uid,
    parse_deployment,
    parse_pod,
)
from quire_operator.status.conditions import Observation, Problem, build_status
from tests.operator_tests.helpers import conditions

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
    api_key: bool = False,
) -> Observation:
    view = parse_deployment(deployment) if deployment is not None else None
    return Observation(
        3, URL, SELECTOR, api_key, problem, view, [parse_pod(pod) for pod in pods or []]
    )


def test_rolled_out_and_ready() -> None:
    done = deployment(2, replicas=2, readyReplicas=2, updatedReplicas=2, availableReplicas=2)
    status = build_status(observe(done), {}, T0)
    assert status == {
        "observedGeneration": 3,
        "desiredReplicas": 2,
        "replicas": 2,
        "readyReplicas": 2,
        "url": URL,
        "auth": "None",
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


def test_an_object_in_the_way_before_any_deployment() -> None:
    message = 'Service "llm" already exists and is not controlled by this InferenceService'
    in_the_way = Problem("NotOwned", message, retry=True)
    status = build_status(observe(None, in_the_way), {}, T0)
    assert conditions(status) == {
        "Ready": ("False", "NotOwned", message),
        "Progressing": ("False", "NotOwned", message),
        "Degraded": ("True", "NotOwned", message),
    }
    assert (status["desiredReplicas"], status["replicas"], status["readyReplicas"]) == (0, 0, 0)


def test_auth_says_whether_the_endpoint_wants_an_api_key() -> None:
    done = deployment(1, replicas=1, readyReplicas=1, updatedReplicas=1, availableReplicas=1)
    assert build_status(observe(done, api_key=True), {}, T0)["auth"] == "APIKey"
    assert build_status(observe(None), {}, T0)["auth"] == "None"


def test_a_missing_secret_shows_as_the_kubelets_config_error() -> None:
    # The operator reads no Secrets: the kubelet's words on the pod name the missing one.
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "llm-key" not found'}
    engine = {"name": "engine", "state": {"waiting": waiting}}
    pending = deployment(1, replicas=1, updatedReplicas=1, unavailableReplicas=1)
    status = build_status(observe(pending, pods=[pod("llm-a", containerStatuses=[engine])]), {}, T0)
    assert conditions(status)["Degraded"] == (
        "True",
        "CreateContainerConfigError",
        'pod llm-a, container engine: secret "llm-key" not found',
    )


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


def test_views_parse_api_json_with_the_api_servers_meaning_of_absent_fields() -> None:
    fresh = parse_deployment({"metadata": {"generation": 1}, "spec": {}})
    assert fresh == DeploymentView(
        generation=1,
        desired=1,  # spec.replicas absent means 1
        observed_generation=0,
        replicas=0,
        updated=0,
        ready=0,
        available=0,
        conditions={},
    )
    assert not fresh.settled and not fresh.rolled_out
    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
    view = parse_deployment(deployment(2, replicas=2, updatedReplicas=2, conditions=[stuck]))
    assert view.conditions == {"Progressing": Condition("False", "ProgressDeadlineExceeded", "")}

    running = {"name": "engine", "state": {"running": {}}}
    crashing = {"name": "dl", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    scheduled = {"type": "PodScheduled", "status": "True"}
    assert parse_pod(
        pod("p", conditions=[scheduled], initContainerStatuses=[crashing],
            containerStatuses=[running])
    ) == PodView("p", None, (Waiting("dl", "CrashLoopBackOff", "CrashLoopBackOff"),))  # fmt: skip
    assert parse_pod({"metadata": {"name": "new"}}) == PodView("new", None, ())


def test_controller_uid_reads_only_the_controller_reference() -> None:
    owners = [
        {"uid": "a", "controller": False},
        {"uid": "b", "controller": True},
    ]
    assert controller_uid({"metadata": {"ownerReferences": owners}}) == "b"
    assert controller_uid({"metadata": {"ownerReferences": owners[:1]}}) is None
    assert controller_uid({"metadata": {}}) is None
