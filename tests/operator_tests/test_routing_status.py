"""Unit tests of the routing part of the status: RoutingReady, status.routing and their Events.

The Deployments, pods and InferencePools are API JSON literals parsed by ``observed`` (the
functions the reconciler uses), so the parsing of what the API server sends is covered too.
"""

from __future__ import annotations

from typing import Any

from quire_operator.observed.views import parse_deployment, parse_pod, parse_pool_parents
from quire_operator.status.conditions import Observation, Problem, RoutingObservation, build_status
from quire_operator.status.events import Transition, transitions
from tests.operator_tests.helpers import conditions

URL = "http://llm.ml.svc.cluster.local:8000"
SELECTOR = "app.kubernetes.io/instance=llm,app.kubernetes.io/name=quire-engine"
T0 = "2026-01-01T00:00:00Z"
ENGINE = {
    "metadata": {"name": "llm", "generation": 1},
    "spec": {"replicas": 1},
    "status": {
        "observedGeneration": 1,
        "replicas": 1,
        "readyReplicas": 1,
        "updatedReplicas": 1,
        "availableReplicas": 1,
    },
}


def picker(ready: int) -> dict[str, Any]:
    status = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}
    if ready:
        status |= {"readyReplicas": ready, "availableReplicas": ready}
    return {
        "metadata": {"name": "llm-epp", "generation": 1},
        "spec": {"replicas": 1},
        "status": status,
    }


def pool(*parents: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "llm"}, "status": {"parents": list(parents)} if parents else {}}


def parent(name: str, **conditions: str) -> dict[str, Any]:
    return {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": name},
        "controllerName": "example.com/gateway",
        "conditions": [
            {
                "type": kind,
                "status": value,
                "reason": "Accepted" if value == "True" else "NotSupportedByParent",
                "message": "" if value == "True" else "no ext_proc here",
                "observedGeneration": 1,
                "lastTransitionTime": T0,
            }
            for kind, value in conditions.items()
        ],
    }


def observe(
    epp: dict[str, Any] | None,
    inference_pool: dict[str, Any] | None,
    problem: Problem | None = None,
    pods: list[dict[str, Any]] | None = None,
) -> Observation:
    routing = RoutingObservation(
        pool="llm",
        endpoint_picker="llm-epp",
        picker=parse_deployment(epp) if epp is not None else None,
        picker_pods=[parse_pod(p) for p in pods or []],
        parents=parse_pool_parents(inference_pool) if inference_pool is not None else None,
    )
    return Observation(1, URL, SELECTOR, False, problem, parse_deployment(ENGINE), [], routing)


def test_ready_picker_and_an_accepting_gateway() -> None:
    accepted = parent("inference-gateway", Accepted="True", ResolvedRefs="True")
    status = build_status(observe(picker(1), pool(accepted)), {}, T0)
    assert [c["type"] for c in status["conditions"]] == [
        "Ready",
        "Progressing",
        "Degraded",
        "RoutingReady",
    ]
    assert conditions(status)["RoutingReady"] == (
        "True",
        "EndpointPickerReady",
        "endpoint picker ready, InferencePool llm: reported by Gateway inference-gateway",
    )
    # The Gateway's report, without its timestamps and generations (they are the pool's).
    assert status["routing"] == {
        "inferencePool": "llm",
        "endpointPicker": "llm-epp",
        "parents": [
            {
                "parentRef": {
                    "group": "gateway.networking.k8s.io",
                    "kind": "Gateway",
                    "namespace": "",
                    "name": "inference-gateway",
                },
                "conditions": [
                    {"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""},
                    {"type": "ResolvedRefs", "status": "True", "reason": "Accepted", "message": ""},
                ],
            }
        ],
    }


def test_no_gateway_yet_is_ready_and_says_so() -> None:
    status = build_status(observe(picker(1), pool()), {}, T0)
    assert conditions(status)["RoutingReady"] == (
        "True",
        "EndpointPickerReady",
        "endpoint picker ready, InferencePool llm: no Gateway reports on the pool yet",
    )
    assert status["routing"]["parents"] == []


def test_a_gateway_refusing_the_pool_is_not_ready_in_its_words() -> None:
    refused = parent("gw", Accepted="False")
    status = build_status(observe(picker(1), pool(refused)), {}, T0)
    assert conditions(status)["RoutingReady"] == (
        "False",
        "NotSupportedByParent",
        "Gateway gw: Accepted=False: no ext_proc here",
    )
    assert conditions(status)["Degraded"] == ("False", "AsExpected", "")


def test_picker_not_ready_and_its_stuck_pod_degrade() -> None:
    waiting = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "epp:typo"'}
    pod = {
        "metadata": {"name": "llm-epp-5d9c-x2"},
        "status": {"containerStatuses": [{"name": "epp", "state": {"waiting": waiting}}]},
    }
    status = build_status(observe(picker(0), pool(), pods=[pod]), {}, T0)
    stuck = 'endpoint picker: pod llm-epp-5d9c-x2, container epp: Back-off pulling image "epp:typo"'
    assert conditions(status)["RoutingReady"] == (
        "False",
        "EndpointPickerNotReady",
        f"0/1 endpoint picker replicas ready; {stuck}",
    )
    assert conditions(status)["Degraded"] == ("True", "ImagePullBackOff", stuck)
    # The engines still serve through their Service.
    assert conditions(status)["Ready"] == ("True", "ReplicasReady", "1/1 replicas ready")


def test_missing_crd_is_degraded_and_not_routing() -> None:
    missing = Problem("InferencePoolCRDMissing", "install the CRD", retry=True)
    status = build_status(observe(None, None, missing), {}, T0)
    assert conditions(status)["RoutingReady"] == (
        "False",
        "InferencePoolCRDMissing",
        "install the CRD",
    )
    assert conditions(status)["Degraded"] == ("True", "InferencePoolCRDMissing", "install the CRD")
    assert status["routing"] == {"inferencePool": "llm", "endpointPicker": "llm-epp", "parents": []}


def test_without_routing_there_is_no_routing_condition_or_status() -> None:
    plain = Observation(1, URL, SELECTOR, False, None, parse_deployment(ENGINE), [])
    status = build_status(plain, {}, T0)
    assert "routing" not in status
    assert "RoutingReady" not in conditions(status)


def test_routing_events_on_gain_and_loss_but_not_when_turned_off() -> None:
    off = build_status(
        Observation(1, URL, SELECTOR, False, None, parse_deployment(ENGINE), []), {}, T0
    )
    waiting = build_status(observe(picker(0), pool()), off, T0)
    ready = build_status(observe(picker(1), pool()), waiting, T0)
    lost = build_status(observe(picker(0), pool()), ready, T0)
    assert transitions(off, waiting) == []
    assert transitions(waiting, ready) == [
        Transition(
            "Normal",
            "RoutingReady",
            "endpoint picker ready, InferencePool llm: no Gateway reports on the pool yet",
        )
    ]
    assert transitions(ready, lost) == [
        Transition("Warning", "RoutingNotReady", "0/1 endpoint picker replicas ready")
    ]
    assert transitions(ready, off) == []  # routing turned off on purpose is no loss
