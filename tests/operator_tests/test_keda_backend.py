"""``autoscaling.backend: keda`` against a control plane without KEDA: the operator says why
the spec cannot run (no Prometheus address; no keda.sh API) as a Degraded condition, keeps the
Deployment, and recovers when the spec goes back to the hpa backend. KEDA itself is exercised end
to end in tests/e2e/."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.api import condition, create_isvc, get_isvc, hpa, patch_spec
from tests.operator_tests.helpers import load_example
from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators

pytestmark = pytest.mark.cluster


def degraded(cluster: ClusterHandle, namespace: str, reason: str) -> Any:
    return wait_for(
        f"Degraded={reason}",
        lambda: get_isvc(cluster, namespace),
        lambda obj: condition(obj, "Degraded").get("reason") == reason,
        timeout_s=60,
    )


def test_keda_backend_reports_what_is_missing_and_recovers(
    cluster: ClusterHandle, crds: GarbageCollectorProbe, namespace: str, operators: Operators
) -> None:
    installed = cluster.kubectl("get", "crd", "scaledobjects.keda.sh")
    assert installed.returncode != 0, "this test needs a cluster without KEDA"
    operators.start()  # no --prometheus-address
    body = load_example()
    body["spec"]["autoscaling"]["backend"] = "keda"
    create_isvc(cluster, namespace, body)

    obj = degraded(cluster, namespace, "InvalidSpec")
    assert "keda needs a Prometheus address" in condition(obj, "Degraded")["message"]

    patch_spec(
        cluster, namespace, {"autoscaling": {"keda": {"serverAddress": "http://127.0.0.1:9"}}}
    )
    obj = degraded(cluster, namespace, "ApplyFailed")
    assert condition(obj, "Degraded")["message"] == (
        "ScaledObject tiny: KEDA is not installed (the API server has no keda.sh/v1alpha1)"
    )
    assert hpa(cluster, namespace) is None  # never an HPA of its own under backend keda

    patch_spec(cluster, namespace, {"autoscaling": {"backend": "hpa"}})
    wait_for(
        "Degraded cleared",
        lambda: get_isvc(cluster, namespace),
        lambda o: condition(o, "Degraded").get("status") == "False",
        timeout_s=60,
    )
    assert hpa(cluster, namespace) is not None
