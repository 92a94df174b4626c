"""Pytest plugin: fixtures for tests against a real Kubernetes control plane (see
docs/test-cluster.md), shared by tests/operator_tests/ and tests/e2e/ so a session starts one
control plane. Loaded by ``pytest_plugins`` in the root tests/conftest.py (pytest accepts
``pytest_plugins`` only there); only the operator and e2e tests request these fixtures.

- ``binaries`` (session): the cached binaries (built if missing), for helm lint/template tests
  that need no running control plane.
- ``cluster`` (session): the binaries, then starts etcd, the API server,
  controller manager, scheduler and kwok once per session, and stops them at the end.
- ``namespace`` (function): a fresh namespace per test, deleted afterwards.
- ``crds`` (session): the repository's CRDs (crds/) applied with kubectl and Established.
- ``operators`` (function): starts ``quire-operator`` processes (``operator_process.Operators``)
  scoped to the test's namespace by default, and stops them all after the test.
- ``routing`` (package): the routing add-on (EPP + Envoy, built on first use) and GIE's CRDs
  installed; a ``tests.cluster.routing.RoutingStack`` that makes pod runners and gateways and
  stops them, and removes the CRDs, when the package's tests are done.

Policy: locally, a machine without Go (and without cached binaries) skips the cluster tests
with the reason; under ``CI=true`` the same situation fails them, because CI must never pass
by skipping the tests that prove the operator against a real API server.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import pytest

from tests.cluster import Binaries, ControlPlane, GoUnavailable, ensure_binaries

if TYPE_CHECKING:
    from tests.cluster.client import ClusterHandle
    from tests.cluster.routing import RoutingStack
    from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators

T = TypeVar("T")

# The running control plane, so the report hook below can attach its logs to failures.
_ACTIVE: ControlPlane | None = None
# The operator processes of the running test, for the same reason.
_OPERATORS: Operators | None = None
# The routing stack, whose pods' and gateways' logs go with a failing test's report.
_ROUTING: RoutingStack | None = None


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> NoReturn:
    """Skip the test locally; fail it under ``CI=true`` (see the policy above)."""
    if _in_ci():
        pytest.fail(f"CI=true and the test cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def binaries(request: pytest.FixtureRequest) -> Binaries:
    """The cached control-plane binaries (built on first use), for tests that need only a tool
    such as helm (lint, template) and no running control plane."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # A cold build takes many minutes; show Go's progress instead of a silent hang.
    show = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with show:
            return ensure_binaries()
    except GoUnavailable as err:
        unavailable(str(err))


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, binaries: Binaries) -> Iterator[ClusterHandle]:
    """A running control plane; yields a ``tests.cluster.client.ClusterHandle``."""
    global _ACTIVE
    try:
        from tests.cluster import client as handles
    except ImportError as err:  # the `kubernetes` package is part of the [operator] extra
        unavailable(f"python package missing: {err}")

    control_plane = ControlPlane(binaries)
    control_plane.start()  # on failure it stops itself and the error carries the log tails
    _ACTIVE = control_plane
    handle = handles.ClusterHandle(control_plane, binaries, control_plane.kubeconfig)
    try:
        yield handle
    finally:
        _ACTIVE = None
        handle.close()
        keep = request.session.testsfailed > 0
        control_plane.stop(keep_logs=keep)
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        if keep and reporter is not None:
            reporter.write_line(f"control-plane logs kept in {control_plane.log_dir}")


@pytest.fixture
def namespace(cluster: ClusterHandle) -> Iterator[str]:
    """A namespace of its own for one test; deleted (asynchronously) afterwards."""
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):  # best effort: the cluster may already be gone
            cluster.core.delete_namespace(name)


@pytest.fixture(scope="session")
def crds(cluster: ClusterHandle) -> Iterator[GarbageCollectorProbe]:
    """The InferenceService and kopf peering CRDs, applied the way a person would; yields the
    probe that tells when garbage collection through InferenceService owners works."""
    from tests.operator_tests.helpers import CRD_PATH, PEERING_CRD_PATH
    from tests.operator_tests.operator_process import GarbageCollectorProbe

    files = [arg for path in (CRD_PATH, PEERING_CRD_PATH) for arg in ("-f", str(path))]
    applied = cluster.kubectl("apply", "--server-side", "--force-conflicts", *files)
    assert applied.returncode == 0, applied.stderr
    names = ["inferenceservices.quire.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"]
    established = cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in names)
    )
    assert established.returncode == 0, established.stderr
    probe = GarbageCollectorProbe(cluster)
    try:
        yield probe
    finally:
        probe.close()


@pytest.fixture
def operators(
    cluster: ClusterHandle, crds: GarbageCollectorProbe, namespace: str, tmp_path: Path
) -> Iterator[Operators]:
    """Operator processes for this test (scoped to its namespace unless told otherwise)."""
    global _OPERATORS
    from tests.operator_tests.operator_process import Operators

    started = Operators(cluster, namespace, tmp_path)
    _OPERATORS = started
    try:
        yield started
    finally:
        started.stop_all()
        _OPERATORS = None


def built(request: pytest.FixtureRequest, ensure: Callable[[], T]) -> T:
    """``ensure()`` (an add-on's build, on first use) with its progress shown; ``unavailable``
    when it cannot be built."""
    from tests.cluster.build import BuildError

    capture = request.config.pluginmanager.getplugin("capturemanager")
    show = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with show:
            return ensure()
    except BuildError as err:  # GoUnavailable included
        unavailable(str(err))


@pytest.fixture(scope="package")
def routing(request: pytest.FixtureRequest, cluster: ClusterHandle) -> Iterator[RoutingStack]:
    global _ROUTING
    from tests.cluster.routing import RoutingStack
    from tests.cluster.routing_build import ensure_routing_binaries

    binaries = built(request, ensure_routing_binaries)
    stack = RoutingStack(cluster.control_plane, binaries)
    _ROUTING = stack
    try:
        stack.install_crds()
        yield stack
    finally:
        _ROUTING = None
        stack.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attach the components' log tails to any failing test that used the cluster."""
    report = yield
    if report.failed and _ACTIVE is not None and "cluster" in getattr(item, "fixturenames", ()):
        dead = _ACTIVE.dead_components()
        header = f"dead components: {', '.join(dead)}\n" if dead else ""
        report.sections.append(("control-plane logs", header + _ACTIVE.log_report()))
    if report.failed and _OPERATORS is not None:
        report.sections.append(("operator logs", _OPERATORS.report()))
    if report.failed and _ROUTING is not None:
        report.sections.append(("routing logs", _ROUTING.report()))
    return report
