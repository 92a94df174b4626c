"""The operator's own metrics: Events and wake-ups counted per InferenceService, served over HTTP.

The counting is checked here on ``events.transitions`` output, as the Reconciler feeds it; the
live operator's counts against its real Events are checked by the chart install test (an Event
of every example) and the scale-to-zero end-to-end test (wake-ups).
"""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from quire_operator.cli import main
from quire_operator.status.events import Transition, transitions
from quire_operator.status.metrics import BindAddress, OperatorMetrics, parse_bind_address
from tests.cluster.process import free_port


def body(name: str, namespace: str = "team-a") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "uid": "u-1"}}


def status(desired: int, zero: str, ready: tuple[str, str]) -> dict[str, Any]:
    """A status of a service that scales to zero: ``zero`` is the ScaledToZero condition's
    status, ``ready`` the Ready condition's (status, reason)."""
    return {
        "observedGeneration": 1,
        "desiredReplicas": desired,
        "conditions": [
            {"type": "Ready", "status": ready[0], "reason": ready[1], "message": "m"},
            {"type": "Progressing", "status": "False", "reason": "RolloutComplete"},
            {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""},
            {"type": "ScaledToZero", "status": zero, "reason": "r", "message": "m"},
        ],
    }


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_bind_addresses() -> None:
    assert parse_bind_address(":8081") == BindAddress("0.0.0.0", 8081)
    assert parse_bind_address("127.0.0.1:9000") == BindAddress("127.0.0.1", 9000)
    assert parse_bind_address("[::1]:9000") == BindAddress("::1", 9000)
    assert parse_bind_address("") is None
    assert parse_bind_address("0") is None
    for bad in ("8081", "host:", "host:http", ":0", ":70000"):
        with pytest.raises(ValueError, match="is not HOST:PORT or :PORT"):
            parse_bind_address(bad)


def test_a_bad_bind_address_stops_the_operator_before_it_reaches_a_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["-A", "--metrics-bind-address", "everywhere"])
    assert exited.value.code == 2
    assert "metrics bind address 'everywhere' is not HOST:PORT or :PORT" in capsys.readouterr().err


def test_wake_ups_and_events_are_counted_per_inference_service() -> None:
    idle = status(0, "True", ("False", "ScaledToZero"))
    waking = status(1, "False", ("False", "NoReplicaReady"))
    serving = status(1, "False", ("True", "ReplicasReady"))
    metrics = OperatorMetrics()
    # Two wake-up cycles of "llm", one of "other" in another namespace, as the Reconciler posts
    # them: every transition between consecutive statuses.
    cycles = [("llm", "team-a"), ("llm", "team-a"), ("other", "team-b")]
    for name, namespace in cycles:
        for before, after in ((idle, waking), (waking, serving), (serving, idle)):
            for transition in transitions(before, after):
                metrics.count(body(name, namespace), transition)
    got = samples(metrics)
    llm = (("name", "llm"), ("namespace", "team-a"))
    other = (("name", "other"), ("namespace", "team-b"))
    assert got[("quire_operator_wakeups_total", llm)] == 2
    assert got[("quire_operator_wakeups_total", other)] == 1

    def events(labels: tuple[tuple[str, str], ...], kind: str, reason: str) -> float:
        key = tuple(sorted([*labels, ("type", kind), ("reason", reason)]))
        return got.get(("quire_operator_events_total", key), 0.0)

    assert events(llm, "Normal", "ScaledFromZero") == 2
    assert events(llm, "Normal", "Ready") == 2
    assert events(llm, "Normal", "ScaledToZero") == 2
    # Ready lost by scaling to zero on purpose is not a Warning (events.transitions).
    assert events(llm, "Warning", "NotReady") == 0
    assert events(other, "Normal", "ScaledFromZero") == 1
    # Any other transition is an Event, and counted as one, but is no wake-up.
    metrics.count(body("llm"), Transition("Warning", "NotOwned", "taken"))
    got = samples(metrics)
    assert events(llm, "Warning", "NotOwned") == 1
    assert got[("quire_operator_wakeups_total", llm)] == 2


def test_served_over_http_from_a_registry_of_its_own() -> None:
    first, second = OperatorMetrics(), OperatorMetrics()
    first.count(body("llm"), Transition("Normal", "ScaledFromZero", "scaled from 0 to 1"))
    port = free_port()
    first.serve(BindAddress("127.0.0.1", port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    assert 'quire_operator_wakeups_total{name="llm",namespace="team-a"} 1.0' in text.splitlines()
    # Nothing of it in another operator's registry (nor in the process-wide default one).
    assert not [key for key in samples(second) if key[0] == "quire_operator_wakeups_total"]
