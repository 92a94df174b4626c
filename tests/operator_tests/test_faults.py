"""Faults (issue 12) against the real control plane: refused writes, a killed operator, an API
server restart, a burst of InferenceServices.

The API server refuses writes the honest way: a validating admission webhook registered for one
namespace and one resource whose URL is a closed loopback port, with failurePolicy Fail. Every
matching create then fails with the API server's own 500 ("failed calling webhook"), exactly as
when a real webhook is down; deleting the configuration lifts it. Nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.process import free_port
from tests.operator_tests.api import (
    NAME,
    condition,
    create_example,
    create_isvc,
    deployment,
    flag,
    get_isvc,
    hpa,
    patch_spec,
    ready,
    service,
)
from tests.operator_tests.helpers import load_example
from tests.operator_tests.operator_process import Operators

pytestmark = pytest.mark.cluster

BURST = 50


@contextlib.contextmanager
def refused_creates(
    cluster: ClusterHandle, namespace: str, group: str, resource: str
) -> Iterator[None]:
    """Every CREATE of ``resource`` in ``namespace`` fails with a 500 until the block ends."""
    name = f"refuse-{resource}-{uuid.uuid4().hex[:6]}"
    rule = {
        "apiGroups": [group],
        "apiVersions": ["*"],
        "operations": ["CREATE"],
        "resources": [resource],
        "scope": "Namespaced",
    }
    body = {
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "refuse.quire.test",
                "clientConfig": {"url": f"https://127.0.0.1:{free_port()}/refuse"},
                "rules": [rule],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }
        ],
    }
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.create_validating_webhook_configuration(body)  # type: ignore[arg-type]  # dict body: the client validates it
    try:
        yield
    finally:
        admission.delete_validating_webhook_configuration(name)


def wait_refusing(cluster: ClusterHandle, namespace: str) -> None:
    """Until the API server has loaded the webhook (a dry-run Service create fails with 500)."""

    def probe() -> int:
        body = {"metadata": {"name": f"probe-{uuid.uuid4().hex[:6]}"},
                "spec": {"ports": [{"port": 80}]}}  # fmt: skip
        try:
            cluster.core.create_namespaced_service(namespace, body, dry_run="All")  # type: ignore[arg-type]  # dict body: the client validates it
        except ApiException as err:
            return int(err.status)
        return 201

    wait_for("the webhook to refuse creates", probe, lambda status: status == 500, timeout_s=30)


def retry_delays(log: str, namespace: str, name: str = NAME) -> list[tuple[int, float]]:
    """(failures so far, delay) of the requeue's retry lines for one InferenceService."""
    pattern = rf"{re.escape(namespace)}/{name}: retry (\d+) in ([0-9.]+)s"
    return [(int(n), float(delay)) for n, delay in re.findall(pattern, log)]


def test_a_repair_the_api_server_refuses_is_retried_with_backoff(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    process = operators.start()
    create_example(cluster, namespace)
    with refused_creates(cluster, namespace, "", "services"):
        wait_refusing(cluster, namespace)
        cluster.core.delete_namespaced_service(NAME, namespace)
        process.wait_for_log(rf"{namespace}/{NAME}: retry 3 in ", timeout_s=30)
        assert service(cluster, namespace) is None  # refused, not faked
    # Lifted: the next retry succeeds, with no new event to prompt it.
    restored = wait_for(
        "the Service recreated", lambda: service(cluster, namespace), lambda s: s is not None,
        timeout_s=30,
    )  # fmt: skip
    assert restored["metadata"]["ownerReferences"][0]["kind"] == meta.KIND
    # Consecutive failures are counted (another trigger meanwhile counts as one more), and the
    # delay doubles with the count: 1 s, 2 s, 4 s, each with at most 20% jitter.
    delays = dict(retry_delays(process.log(), namespace))
    assert {1, 2, 3} <= delays.keys(), delays
    assert delays[1] < delays[2] < delays[3], delays
    assert "500" in process.log()  # the API server's answer is logged with the retry


def test_the_periodic_resync_repairs_what_no_event_announces(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    process = operators.start("--resync-seconds", "2")
    isvc = create_example(cluster, namespace)
    # A status overwritten by someone else: kopf ignores status-only changes and no child
    # changed, so no watch event leads back to it; only the resync does.
    bogus = {"status": {"url": "http://elsewhere", "conditions": [
        {"type": "Ready", "status": "False", "reason": "Bogus", "message": "edited by hand"},
    ]}}  # fmt: skip
    cluster.custom.patch_namespaced_custom_object_status(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, NAME, bogus
    )
    repaired = wait_for(
        "the status rewritten by the resync",
        lambda: get_isvc(cluster, namespace),
        lambda obj: condition(obj, "Ready").get("reason") == "ReplicasReady",
        timeout_s=30,
    )
    assert repaired["status"]["url"] == isvc["status"]["url"]
    process.wait_for_log(r"resync: reconciling 1 InferenceService\(s\)")


def test_an_operator_killed_between_deployment_and_hpa_converges_without_duplicates(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    with refused_creates(cluster, namespace, "autoscaling", "horizontalpodautoscalers"):
        first = operators.start("--priority", "10", "--peering-lifetime", "6", name="first")
        create_isvc(cluster, namespace, load_example())
        # The Deployment (and Service) are applied; the HPA is refused and being retried.
        first.wait_for_log(rf"{namespace}/{NAME}: retry 1 in ", timeout_s=30)
        before = wait_for(
            "the Deployment rolled out", lambda: deployment(cluster, namespace),
            lambda d: d is not None and d.get("status", {}).get("readyReplicas") == 1,
        )  # fmt: skip
        assert hpa(cluster, namespace) is None
        first.kill()
    second = operators.start("--priority", "5", name="second")
    isvc = ready(cluster, namespace)
    assert condition(isvc, "Degraded")["reason"] == "AsExpected"
    wait_for("the HPA", lambda: hpa(cluster, namespace), lambda h: h is not None)

    after = deployment(cluster, namespace)
    # The same Deployment, untouched by the restart: no new generation, no new ReplicaSet, no
    # replica change; and exactly one of each child.
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["replicas"] == before["spec"]["replicas"] == 1
    selector = meta.selector_string(NAME)
    counts = {
        "deployments": len(cluster.apps.list_namespaced_deployment(namespace).items),
        "replicasets": len(
            cluster.apps.list_namespaced_replica_set(namespace, label_selector=selector).items
        ),
        "hpas": len(cluster.autoscaling.list_namespaced_horizontal_pod_autoscaler(namespace).items),
        "services": len(cluster.core.list_namespaced_service(namespace).items),
    }
    assert counts == {"deployments": 1, "replicasets": 1, "hpas": 1, "services": 1}
    assert second.process.exited() is None


def test_the_operator_outlives_an_api_server_restart(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    process = operators.start()
    create_example(cluster, namespace)
    cluster.control_plane.restart_apiserver()
    # Its watches reconnect: a spec change and a deleted child are both handled.
    patch_spec(cluster, namespace, {"engine": {"blockSize": 32}})
    ready(cluster, namespace, generation=2)
    assert flag(deployment(cluster, namespace), "--block-size") == "32"
    old = service(cluster, namespace)["metadata"]["uid"]
    cluster.core.delete_namespaced_service(NAME, namespace)
    wait_for(
        "the Service recreated",
        lambda: service(cluster, namespace),
        lambda s: s is not None and s["metadata"]["uid"] != old,
        timeout_s=30,
    )
    assert process.process.exited() is None


def _peak_rss_mib(pid: int) -> float:
    """VmHWM: the process's peak resident set size so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@pytest.mark.slow
def test_a_burst_of_inference_services_reconciles_in_bounded_time(
    cluster: ClusterHandle,
    namespace: str,
    operators: Operators,
    record_property: Any,
) -> None:
    process = operators.start()
    idle_mib = _peak_rss_mib(process.process.pid)
    spec = {"model": {"uri": "tiny"}, "resources": {"gpus": 0}, "replicas": 1}
    started = time.monotonic()
    for index in range(BURST):
        body = {"apiVersion": meta.API_VERSION, "kind": meta.KIND,
                "metadata": {"name": f"burst-{index:02d}"}, "spec": spec}  # fmt: skip
        create_isvc(cluster, namespace, body)
    created_s = time.monotonic() - started

    def settled() -> int:
        items = cluster.json(
            cluster.custom.list_namespaced_custom_object(
                meta.GROUP, meta.VERSION, namespace, meta.PLURAL
            )
        )["items"]
        return sum(
            1
            for obj in items
            if obj.get("status", {}).get("observedGeneration") == 1
            and (
                condition(obj, "Ready").get("status") == "True"
                or condition(obj, "Progressing").get("status") == "True"
            )
        )

    wait_for(f"{BURST} services Ready or Progressing", settled, lambda n: n == BURST,
             timeout_s=300, interval_s=1)  # fmt: skip
    settled_s = time.monotonic() - started
    deployments = cluster.apps.list_namespaced_deployment(namespace).items
    assert len(deployments) == BURST
    figures = {
        "inference_services": BURST,
        "create_s": round(created_s, 1),
        "ready_or_progressing_s": round(settled_s, 1),
        "operator_peak_rss_mib": round(_peak_rss_mib(process.process.pid), 1),
        "operator_idle_rss_mib": round(idle_mib, 1),
    }
    for key, value in figures.items():
        record_property(key, value)
    print("burst:", json.dumps(figures))
