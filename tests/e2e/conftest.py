"""Fixtures for the autoscaling end-to-end tests.

- ``cluster``, ``namespace``, ``crds``, ``operators``: the shared control-plane fixtures of
  tests/cluster/pytest_plugin.py (one control plane per session, also used by the operator
  tests).
- ``autoscaling_binaries`` (session): KEDA and prometheus-adapter built from their Go modules and
  Prometheus unpacked from Debian's package, cached under ~/.cache/quire (first run: tens of
  minutes, mostly KEDA). Same policy as the cluster: skipped locally without Go, failed under
  ``CI=true``.
- ``stack`` (package): Prometheus, KEDA and prometheus-adapter on loopback, the adapter running
  the chart's rules as ``helm template`` renders them.
- ``lws`` (package): the LeaderWorkerSet controller (built from its Go module on first use)
  running with its webhooks and CRDs (``tests.cluster.lws.LwsStack``); stopped, and its CRDs
  removed, once the e2e tests are done, so later tests see a cluster without LeaderWorkerSets.
- ``scenario`` (function): makes ``scaling_scenario.Scenario`` objects with an operator that
  knows the Prometheus address, and closes them (engines, load) after the test.
- ``fleet`` (function): makes ``routed_fleet.RoutedFleet`` objects (an InferenceService routed
  through an InferencePool, its engines and picker running) and closes them after the test.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.cluster.build import BuildError, GoUnavailable
from tests.cluster.pytest_plugin import built, unavailable

if TYPE_CHECKING:
    from tests.cluster.addons import AutoscalingStack
    from tests.cluster.addons_build import AutoscalingBinaries
    from tests.cluster.client import ClusterHandle
    from tests.cluster.lws import LwsStack
    from tests.cluster.routing import RoutingStack
    from tests.e2e.routed_fleet import RoutedFleet
    from tests.e2e.scaling_scenario import Scenario
    from tests.operator_tests.operator_process import Operators

_STACK: AutoscalingStack | None = None
_LWS: LwsStack | None = None
_SCENARIOS: list[Scenario] = []


@pytest.fixture(scope="session")
def autoscaling_binaries(request: pytest.FixtureRequest) -> AutoscalingBinaries:
    from tests.cluster.addons_build import ensure_autoscaling_binaries

    capture = request.config.pluginmanager.getplugin("capturemanager")
    show = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with show:
            return ensure_autoscaling_binaries()
    except (GoUnavailable, BuildError) as err:
        unavailable(str(err))


# Package scope: KEDA, Prometheus and the adapter stop once the e2e tests are done, instead of
# idling through the rest of the session.
@pytest.fixture(scope="package")
def stack(
    cluster: ClusterHandle, autoscaling_binaries: AutoscalingBinaries
) -> Iterator[AutoscalingStack]:
    global _STACK
    from tests.cluster.addons import AutoscalingStack

    started = AutoscalingStack(cluster.control_plane, autoscaling_binaries)
    _STACK = started
    try:
        started.start_prometheus()
        started.start_keda()
        started.start_prometheus_adapter(started.chart_adapter_rules())
        yield started
    finally:
        _STACK = None
        started.stop()


@pytest.fixture(scope="package")
def lws(request: pytest.FixtureRequest, cluster: ClusterHandle) -> Iterator[LwsStack]:
    global _LWS
    from tests.cluster.lws import LwsStack
    from tests.cluster.lws_build import ensure_lws_binaries

    started = LwsStack(cluster.control_plane, built(request, ensure_lws_binaries))
    _LWS = started
    try:
        started.start()
        yield started
    finally:
        _LWS = None
        started.stop()


@pytest.fixture
def scenario(
    cluster: ClusterHandle,
    stack: AutoscalingStack,
    namespace: str,
    operators: Operators,
    tmp_path: Path,
) -> Iterator[Callable[..., Scenario]]:
    """``scenario(name, backend[, routing])`` -> a Scenario in this test's namespace, operator
    running (routed through an InferencePool when given the ``routing`` stack, which a test
    must then request before ``scenario``: the operator watches pools only if their CRD is
    served when it starts)."""
    from tests.e2e.scaling_scenario import Scenario

    operators.start("--prometheus-address", stack.prometheus_url)
    made: list[Scenario] = []

    def make(name: str, backend: str, routing: RoutingStack | None = None) -> Scenario:
        created = Scenario(cluster, stack, namespace, name, backend, tmp_path, routing)
        made.append(created)
        _SCENARIOS.append(created)
        return created

    try:
        yield make
    finally:
        for created in made:
            created.close()
            _SCENARIOS.remove(created)
            _save_timeline(created.timeline.as_json())


@pytest.fixture
def fleet(
    cluster: ClusterHandle, routing: RoutingStack, namespace: str, operators: Operators
) -> Iterator[Callable[..., RoutedFleet]]:
    """``fleet(name, replicas, **settings)`` -> a RoutedFleet whose engines and picker serve
    (``settings``: ``RoutedFleet.create``'s)."""
    from tests.e2e.routed_fleet import RoutedFleet

    operators.start()  # after `routing`: the InferencePool CRD is served when it starts
    made: list[RoutedFleet] = []
    routing_stack = routing  # ``routing`` below is the InferenceService's routing settings

    def make(name: str, replicas: int, **settings: Any) -> RoutedFleet:
        created = RoutedFleet(cluster, routing_stack, namespace, name)
        made.append(created)
        created.create(replicas, **settings)
        return created

    try:
        yield make
    finally:
        for created in made:
            created.close()


_TIMELINES: list[str] = []  # rendered, for the terminal summary


def _save_timeline(timeline: dict[str, Any]) -> None:
    """Keep it for the terminal summary, and append it to ``$QUIRE_E2E_TIMELINES`` (JSON
    lines) when that is set: docs/autoscaling.md's figures come from there."""
    events = "\n".join(f"  +{t:6.1f}s  {what}" for t, what in timeline["events"])
    _TIMELINES.append(f"{timeline['name']}:\n{events}")
    target = os.environ.get("QUIRE_E2E_TIMELINES")
    if target:
        with open(target, "a") as out:
            out.write(json.dumps(timeline) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attach the timeline, the add-ons' and the engines' log tails to a failing test."""
    report = yield
    if report.when == "call":
        for created in _SCENARIOS:
            report.sections.append((f"timeline {created.timeline.name}", created.timeline.render()))
    if report.failed:
        if _STACK is not None:
            dead = _STACK.dead_components()
            header = f"dead add-ons: {', '.join(dead)}\n" if dead else ""
            report.sections.append(("autoscaling add-on logs", header + _STACK.log_report()))
        if _LWS is not None:
            report.sections.append(("LeaderWorkerSet controller log", _LWS.report()))
        for created in _SCENARIOS:
            errors = "\n".join(
                created.runner.errors + (created.load.errors[-5:] if created.load else [])
            )
            report.sections.append(("engines", errors + "\n" + created.runner.report()))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every scenario's timeline at the end of the run, passed or failed."""
    if _TIMELINES:
        terminalreporter.section("autoscaling timelines")
        for text in _TIMELINES:
            terminalreporter.write_line(text)
