"""Unit tests of the operator's wiring: child-event routing and the command line.

``ChildEvents`` gets a recording stand-in for ``Requeue.run`` (the Kubernetes API is not involved
at all here; the cluster tests cover the real thing).
"""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from quire_operator.cli import build_parser, main
from quire_operator.config import DEFAULT_EPP_IMAGE
from quire_operator.handlers import CHILDREN, POOLS, ChildEvents
from tests.operator_tests.helpers import ROOT


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def run(self, namespace: str, name: str) -> None:
        self.calls.append((namespace, name))


def child(plural: str) -> Any:
    return next(c for c in CHILDREN if c.plural == plural)


def event(kind: str | None, uid: str = "u1", generation: int = 1, **labels: str) -> Any:
    labels = labels or {"app.kubernetes.io/instance": "llm"}
    metadata = {"uid": uid, "namespace": "ml", "generation": generation, "labels": labels}
    return {"type": kind, "object": {"metadata": metadata}}


def routed(recorder: Recorder) -> ChildEvents:
    return ChildEvents(recorder.run)


def test_every_deployment_and_pod_event_reconciles_the_owner() -> None:
    recorder = Recorder()
    events = routed(recorder)
    for kind in (None, "ADDED", "MODIFIED", "MODIFIED", "DELETED"):
        events.handle(child("deployments"), event(kind))
    events.handle(child("pods"), event("MODIFIED", uid="p1"))
    assert recorder.calls == [("ml", "llm")] * 6


def test_hpa_events_reconcile_only_on_spec_changes_and_deletion() -> None:
    recorder = Recorder()
    events = routed(recorder)
    hpa = child("horizontalpodautoscalers")
    events.handle(hpa, event(None, generation=1))  # first sight (startup listing): recorded
    events.handle(hpa, event("MODIFIED", generation=1))  # status churn: nothing to do
    assert recorder.calls == []
    events.handle(hpa, event("MODIFIED", generation=2))  # someone edited the spec
    events.handle(hpa, event("DELETED", generation=2))  # someone deleted it
    assert recorder.calls == [("ml", "llm"), ("ml", "llm")]
    events.handle(hpa, event("ADDED", generation=1))  # the operator's own re-creation
    assert len(recorder.calls) == 2


def test_every_pool_event_reconciles_the_owner() -> None:
    # The Gateways write their verdicts into the pool's status: each one reaches status.routing.
    assert (POOLS.group, POOLS.version, POOLS.plural) == (
        "inference.networking.k8s.io",
        "v1",
        "inferencepools",
    )
    recorder = Recorder()
    events = routed(recorder)
    for kind in (None, "MODIFIED", "MODIFIED", "DELETED"):
        events.handle(POOLS, event(kind))
    assert recorder.calls == [("ml", "llm")] * 4


def test_objects_without_an_owner_label_are_ignored() -> None:
    recorder = Recorder()
    routed(recorder).handle(child("deployments"), event("MODIFIED", app="other"))
    assert recorder.calls == []


def test_command_line_scope_and_defaults() -> None:
    parser = build_parser()
    args = parser.parse_args(["-n", "a", "--namespace", "b"])
    assert (args.namespaces, args.all_namespaces) == (["a", "b"], False)
    assert (args.peering, args.standalone, args.priority) == ("quire-operator", False, None)
    assert (args.liveness, args.peering_lifetime) == ("http://0.0.0.0:8080/healthz", 60)
    assert args.resync_seconds == 300
    assert args.epp_image == DEFAULT_EPP_IMAGE
    assert parser.parse_args(["-A", "--standalone"]).all_namespaces
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a scope is required: never "everything" by accident
    with pytest.raises(SystemExit):
        parser.parse_args(["-A", "-n", "a"])


def test_console_script_points_at_the_cli() -> None:
    # Read from pyproject.toml: installed metadata can be a stale egg-info in the checkout.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["quire-operator"] == "quire_operator.cli:main"
    assert callable(main)
