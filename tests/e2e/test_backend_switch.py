"""Switching ``spec.autoscaling.backend`` on a live InferenceService: the operator deletes the
other backend's object (its own only) before it applies the new one, KEDA's HPA comes and goes
with the ScaledObject, and the Deployment's replicas never jump (to ``spec.replicas`` or
anywhere else) during the switches. No engines: the replica count here is minReplicas."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.cluster.addons import AutoscalingStack
from tests.cluster.client import ClusterHandle
from tests.e2e.scaling_scenario import poll
from tests.operator_tests.operator_process import Operators

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION, PLURAL = "quire.dev", "v1alpha1", "inferenceservices"


def test_switching_backend_replaces_the_autoscaler_without_a_replica_jump(
    cluster: ClusterHandle, stack: AutoscalingStack, namespace: str, operators: Operators
) -> None:
    operators.start("--prometheus-address", stack.prometheus_url)
    name = "switch"
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": "tiny"},
            "resources": {"gpus": 0},
            "replicas": 3,  # used only with autoscaling off: must never show up while it is on
            "autoscaling": {
                "enabled": True,
                "backend": "hpa",
                "minReplicas": 2,
                "maxReplicas": 4,
                "targetQueueDepth": 4,
            },
        },
    }
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def hpa(hpa_name: str) -> dict[str, Any] | None:
        try:
            found = cluster.autoscaling.read_namespaced_horizontal_pod_autoscaler(
                hpa_name, namespace
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        obj: dict[str, Any] = cluster.json(found)
        return obj

    def scaled_object() -> dict[str, Any] | None:
        try:
            obj = cluster.custom.get_namespaced_custom_object(
                "keda.sh", "v1alpha1", namespace, "scaledobjects", name
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        assert isinstance(obj, dict)
        return obj

    def replicas() -> int:
        return int(cluster.apps.read_namespaced_deployment(name, namespace).spec.replicas or 0)

    def switch(backend: str) -> None:
        patch = {"spec": {"autoscaling": {"backend": backend}}}
        cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, patch
        )

    poll("the operator's HPA", lambda: hpa(name), lambda h: h is not None, 60)
    poll("minReplicas applied by the HPA", replicas, lambda n: n == 2, 60)
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.3):
            seen.append(replicas())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        switch("keda")
        poll("the HPA deleted", lambda: hpa(name), lambda h: h is None, 60)
        created = poll("a ScaledObject", scaled_object, lambda so: so is not None, 60)
        assert created is not None
        owner = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        assert isinstance(owner, dict)
        uid = owner["metadata"]["uid"]
        assert [o["uid"] for o in created["metadata"]["ownerReferences"]] == [uid]
        keda_hpa = poll("KEDA's HPA", lambda: hpa(f"keda-hpa-{name}"), bool, 60)
        assert keda_hpa is not None
        assert keda_hpa["spec"]["minReplicas"] == 2

        switch("hpa")
        poll("the ScaledObject deleted", scaled_object, lambda so: so is None, 60)
        poll("the operator's HPA back", lambda: hpa(name), lambda h: h is not None, 60)
        poll("KEDA's HPA collected", lambda: hpa(f"keda-hpa-{name}"), lambda h: h is None, 90)
    finally:
        done.set()
        sampler.join(timeout=5)
    assert seen and set(seen) == {2}, f"replicas during the switches: {sorted(set(seen))}"

    off = {"spec": {"autoscaling": {"enabled": False}}}
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, off)
    poll("replicas from the spec once autoscaling is off", replicas, lambda n: n == 3, 60)
    assert hpa(name) is None and scaled_object() is None
