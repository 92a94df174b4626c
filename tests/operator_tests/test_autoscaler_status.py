"""status.autoscaler, the ScaledToZero condition and the Events of scaling to and from zero:
pure, exact values from API JSON literals parsed by ``observed``."""

from __future__ import annotations

from typing import Any

from quire_operator.handlers import CHILDREN, SCALED_OBJECTS, ChildEvents
from quire_operator.observed.views import parse_autoscaler, parse_deployment
from quire_operator.status.conditions import Observation, build_status
from quire_operator.status.events import Transition, transitions

URL = "http://llm.ml.svc.cluster.local:8000"
SELECTOR = "app.kubernetes.io/instance=llm,app.kubernetes.io/name=quire-engine"
T0 = "2026-01-01T00:00:00Z"

HPA = {
    "kind": "HorizontalPodAutoscaler",
    "metadata": {"name": "llm", "generation": 1},
    "status": {
        "currentReplicas": 4,
        "desiredReplicas": 4,
        "conditions": [
            {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale",
             "message": "recommended size matches current size", "lastTransitionTime": T0},
            {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound",
             "message": "the HPA was able to compute the replica count"},
            {"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas",
             "message": "the desired replica count is more than the maximum replica count"},
        ],
    },
}  # fmt: skip
SCALED_OBJECT = {
    "kind": "ScaledObject",
    "metadata": {"name": "llm", "generation": 1},
    "status": {
        "hpaName": "keda-hpa-llm",
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"},
            {"type": "Active", "status": "False", "reason": "ScalerNotActive", "message": "idle"},
            {"type": "Fallback", "status": "False", "reason": "NoFallbackFound", "message": ""},
            {"type": "Paused", "status": "False", "reason": "ScaledObjectUnpaused"},
        ],
    },
}


def engine(desired: int, ready: int | None = None) -> dict[str, Any]:
    ready = desired if ready is None else ready
    counts = {"replicas": desired, "readyReplicas": ready, "updatedReplicas": desired}
    return {
        "metadata": {"name": "llm", "generation": 1},
        "spec": {"replicas": desired},
        "status": {"observedGeneration": 1, "availableReplicas": ready, **counts},
    }


def observe(
    desired: int,
    autoscaler: dict[str, Any] | None,
    zero: bool,
    ready: int | None = None,
    held: int | None = None,
) -> Observation:
    return Observation(
        1,
        URL,
        SELECTOR,
        False,
        None,
        parse_deployment(engine(desired, ready)),
        [],
        autoscaler=None if autoscaler is None else parse_autoscaler(autoscaler),
        scales_to_zero=zero,
        held=held,
    )


def test_hpa_state_is_copied_with_its_replicas_and_conditions() -> None:
    status = build_status(observe(4, HPA, zero=False), {}, T0)
    assert status["autoscaler"] == {
        "kind": "HorizontalPodAutoscaler",
        "name": "llm",
        "currentReplicas": 4,
        "desiredReplicas": 4,
        "conditions": [
            {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale",
             "message": "recommended size matches current size"},
            {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound",
             "message": "the HPA was able to compute the replica count"},
            {"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas",
             "message": "the desired replica count is more than the maximum replica count"},
        ],
    }  # fmt: skip
    assert "ScaledToZero" not in [c["type"] for c in status["conditions"]]


def test_scaled_object_state_has_its_conditions_and_no_replica_counts() -> None:
    status = build_status(observe(0, SCALED_OBJECT, zero=True), {}, T0)
    assert status["autoscaler"] == {
        "kind": "ScaledObject",
        "name": "llm",
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"},
            {"type": "Active", "status": "False", "reason": "ScalerNotActive", "message": "idle"},
            {"type": "Fallback", "status": "False", "reason": "NoFallbackFound", "message": ""},
        ],
    }


def test_autoscaling_off_has_no_autoscaler_status() -> None:
    assert "autoscaler" not in build_status(observe(1, None, zero=False), {}, T0)


def test_scaled_to_zero_condition_and_events_both_ways() -> None:
    running = build_status(observe(1, SCALED_OBJECT, zero=True), {}, T0)
    idle = build_status(observe(0, SCALED_OBJECT, zero=True), running, T0)
    woken = build_status(observe(2, SCALED_OBJECT, zero=True), idle, T0)
    zero = {c["type"]: (c["status"], c["reason"], c["message"]) for c in idle["conditions"]}
    assert zero["ScaledToZero"] == ("True", "NoReplicas", "the Deployment has 0 replicas")
    assert Transition("Normal", "ScaledToZero", "scaled to 0 replicas (idle)") in transitions(
        running, idle
    )
    assert Transition("Normal", "ScaledFromZero", "scaled from 0 to 2 replicas") in transitions(
        idle, woken
    )
    # Not ready at zero on purpose: no NotReady Warning (it comes back with a replica).
    assert "NotReady" not in {t.reason for t in transitions(running, idle)}
    # The first status (no ScaledToZero before) and an unchanged one post no zero Event.
    reasons = {t.reason for t in transitions({}, running) + transitions(idle, idle)}
    assert not reasons & {"ScaledToZero", "ScaledFromZero"}


def test_waking_from_zero_says_how_many_requests_are_held() -> None:
    idle = build_status(observe(0, SCALED_OBJECT, zero=True), {}, T0)
    waking = build_status(observe(1, SCALED_OBJECT, zero=True, ready=0, held=3), idle, T0)
    unknown = build_status(observe(1, SCALED_OBJECT, zero=True, ready=0), idle, T0)
    serving = build_status(observe(1, SCALED_OBJECT, zero=True), waking, T0)

    def zero(status: dict[str, Any]) -> tuple[str, str, str]:
        (c,) = [c for c in status["conditions"] if c["type"] == "ScaledToZero"]
        return c["status"], c["reason"], c["message"]

    message = "waking: 1 replicas starting, 3 requests held by the endpoint picker"
    assert zero(waking) == ("False", "Waking", message)
    assert zero(unknown)[2] == "waking: 1 replicas starting, requests held by the endpoint picker"
    assert zero(serving) == ("False", "Scaled", "the Deployment has 1 replicas")
    # Waking is already "from zero": its Event is posted then, and not again once it serves.
    assert Transition("Normal", "ScaledFromZero", "scaled from 0 to 1 replicas") in transitions(
        idle, waking
    )
    assert "ScaledFromZero" not in {t.reason for t in transitions(waking, serving)}


def test_last_scale_records_each_change_of_the_replica_count_and_keeps_it_otherwise() -> None:
    T1, T2 = "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"
    first = build_status(observe(1, HPA, zero=False), {}, T0)
    assert "lastScale" not in first["autoscaler"]  # nothing to compare with yet
    up = build_status(observe(4, HPA, zero=False), first, T1)
    expected = {"time": T1, "from": 1, "to": 4, "direction": "Up"}
    assert up["autoscaler"]["lastScale"] == expected
    same = build_status(observe(4, HPA, zero=False), up, T2)
    assert same == up  # unchanged world, unchanged status
    down = build_status(observe(0, SCALED_OBJECT, zero=True), same, T2)
    assert down["autoscaler"]["lastScale"] == {"time": T2, "from": 4, "to": 0, "direction": "Down"}


def test_hpa_verdict_changes_reconcile_and_status_churn_does_not() -> None:
    calls: list[tuple[str, str]] = []
    events = ChildEvents(lambda namespace, name: calls.append((namespace, name)))
    hpa = next(c for c in CHILDREN if c.plural == "horizontalpodautoscalers")

    def event(conditions: list[dict[str, str]], replicas: int, at: str) -> Any:
        labels = {"app.kubernetes.io/instance": "llm"}
        metadata = {"uid": "u1", "namespace": "ml", "generation": 1, "labels": labels}
        status = {"desiredReplicas": replicas, "lastScaleTime": at, "conditions": conditions}
        return {"type": "MODIFIED", "object": {"metadata": metadata, "status": status}}

    active = [{"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"}]
    failing = [{"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric"}]
    events.handle(hpa, event(active, 1, T0))  # first sight: recorded
    events.handle(hpa, event(active, 1, "2026-01-01T00:05:00Z"))  # timestamps only
    assert calls == []
    events.handle(hpa, event(failing, 1, T0))  # scaling stopped working
    events.handle(hpa, event(failing, 3, T0))  # a new replica choice
    assert calls == [("ml", "llm")] * 2


def test_scaled_object_verdict_changes_reconcile_and_polls_do_not() -> None:
    calls: list[tuple[str, str]] = []
    events = ChildEvents(lambda namespace, name: calls.append((namespace, name)))

    def event(active: str, last_active: str) -> Any:
        labels = {"app.kubernetes.io/instance": "llm"}
        metadata = {"uid": "s1", "namespace": "ml", "generation": 1, "labels": labels}
        conditions = [{"type": "Active", "status": active, "reason": "ScalerActive"}]
        status = {"lastActiveTime": last_active, "conditions": conditions}
        return {"type": "MODIFIED", "object": {"metadata": metadata, "status": status}}

    events.handle(SCALED_OBJECTS, event("True", T0))  # first sight: recorded
    events.handle(SCALED_OBJECTS, event("True", "2026-01-01T00:00:15Z"))  # KEDA's poll
    assert calls == []
    events.handle(SCALED_OBJECTS, event("False", "2026-01-01T00:00:15Z"))  # went idle
    assert calls == [("ml", "llm")]
