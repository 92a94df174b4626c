"""``spec.parallelism.nodes`` above 1 against a control plane without the LeaderWorkerSet CRD: the
operator says so as a Degraded condition, applies nothing (the Deployment of one node keeps
serving), and recovers when the spec goes back to one node. LeaderWorkerSets themselves are
exercised end to end in tests/e2e/test_leader_worker_set.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.api import condition, create_isvc, deployment, get_isvc, patch_spec
from tests.operator_tests.helpers import load_example
from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators

pytestmark = pytest.mark.cluster


def degraded(cluster: ClusterHandle, namespace: str, reason: str | None) -> Any:
    def settled(obj: Any) -> bool:
        found = condition(obj, "Degraded")
        if reason is None:
            return bool(found.get("status") == "False")
        return bool(found.get("reason") == reason)

    return wait_for(
        f"Degraded={reason}", lambda: get_isvc(cluster, namespace), settled, timeout_s=60
    )


def test_nodes_without_the_leader_worker_set_crd_degrade_and_keep_the_deployment(
    cluster: ClusterHandle, crds: GarbageCollectorProbe, namespace: str, operators: Operators
) -> None:
    installed = cluster.kubectl("get", "crd", "leaderworkersets.leaderworkerset.x-k8s.io")
    assert installed.returncode != 0, "this test needs a cluster without LeaderWorkerSets"
    operators.start()
    create_isvc(cluster, namespace, load_example())
    degraded(cluster, namespace, None)
    before = deployment(cluster, namespace)
    assert before is not None

    patch_spec(cluster, namespace, {"parallelism": {"nodes": 2}})
    obj = degraded(cluster, namespace, "LeaderWorkerSetCRDMissing")
    assert condition(obj, "Degraded")["message"] == (
        "spec.parallelism.nodes above 1 runs each replica as a LeaderWorkerSet, but the API "
        "server does not serve leaderworkerset.x-k8s.io/v1 LeaderWorkerSets: install the "
        "LeaderWorkerSet controller; nothing of the spec is applied until then"
    )
    after = deployment(cluster, namespace)
    assert after is not None and after["metadata"]["uid"] == before["metadata"]["uid"]

    patch_spec(cluster, namespace, {"parallelism": {"nodes": 1}})
    degraded(cluster, namespace, None)
