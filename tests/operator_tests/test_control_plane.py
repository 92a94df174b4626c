"""Acceptance tests of the test cluster itself (issue 5): the real control plane behaves as one.

Each test proves one piece of machinery the operator relies on, with exact assertions and bounded
waits: scheduling onto the fake GPU node (and refusing impossible requests), garbage collection
through owner references, the HPA controller, CRD structural schemas and CEL validation, and the
cached CLIs. Objects are created as plain dicts, exactly as they would be written in YAML.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.cluster.build import HELM_VERSION, K8S_VERSION, cache_root
from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.nodes import CPU_NODE, GPU_NODE, GPU_RESOURCE, GPU_TOLERATION, GPUS_PER_NODE

pytestmark = pytest.mark.cluster

# kwok never pulls images; the name only has to be valid.
IMAGE = "quire.invalid/engine:test"


# Manifests are typed Any: the typed client's signatures name model classes, but it sends
# dicts unchanged, and dicts read like the YAML an operator would apply.


def deployment(name: str, *, gpus: int = 0, tolerate_gpu: bool = False, replicas: int = 1) -> Any:
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    if gpus:
        # Extended resources are requested through limits (requests default to them).
        resources["limits"] = {GPU_RESOURCE: str(gpus)}
    container = {"name": "main", "image": IMAGE, "resources": resources}
    pod_spec: dict[str, Any] = {"containers": [container]}
    if tolerate_gpu:
        pod_spec["tolerations"] = [GPU_TOLERATION]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
        },
    }


def pods_of(cluster: ClusterHandle, namespace: str, app: str) -> list[Any]:
    """The app's pods as JSON dicts."""
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=f"app={app}")
    return list(cluster.json(pods)["items"])


def replicasets_of(cluster: ClusterHandle, namespace: str, app: str) -> list[Any]:
    sets = cluster.apps.list_namespaced_replica_set(namespace, label_selector=f"app={app}")
    return list(cluster.json(sets)["items"])


def condition(obj: Any, kind: str) -> Any:
    """The status condition of type ``kind`` (a dict), or None."""
    return next((c for c in obj["status"].get("conditions", []) if c["type"] == kind), None)


def phase(pod: Any) -> Any:
    return pod["status"].get("phase")


def test_gpu_deployment_runs_on_the_gpu_node(cluster: ClusterHandle, namespace: str) -> None:
    gpu = deployment("gpu", gpus=1, tolerate_gpu=True)
    cluster.apps.create_namespaced_deployment(namespace, gpu)

    pods = wait_for(
        "one Running pod of the GPU deployment",
        lambda: pods_of(cluster, namespace, "gpu"),
        lambda pods: len(pods) == 1 and phase(pods[0]) == "Running",
        timeout_s=60,
    )
    (pod,) = pods
    assert pod["spec"]["nodeName"] == GPU_NODE
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {GPU_RESOURCE: "1"}
    assert condition(pod, "Ready")["status"] == "True"
    node = cluster.json(cluster.core.read_node(GPU_NODE))
    assert node["status"]["allocatable"][GPU_RESOURCE] == str(GPUS_PER_NODE)


def test_more_gpus_than_any_node_has_stays_pending(cluster: ClusterHandle, namespace: str) -> None:
    too_many = GPUS_PER_NODE * 2
    cluster.apps.create_namespaced_deployment(
        namespace, deployment("huge", gpus=too_many, tolerate_gpu=True)
    )

    pods = wait_for(
        "the scheduler to mark the pod Unschedulable",
        lambda: pods_of(cluster, namespace, "huge"),
        lambda pods: len(pods) == 1 and condition(pods[0], "PodScheduled") is not None,
        timeout_s=60,
    )
    (pod,) = pods
    scheduled = condition(pod, "PodScheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    # Both nodes lack 16 GPUs (the CPU node has none), so both are listed as insufficient.
    assert scheduled["message"].startswith(
        f"0/2 nodes are available: 2 Insufficient {GPU_RESOURCE}."
    )
    assert phase(pod) == "Pending"
    assert "nodeName" not in pod["spec"]


def test_gpu_pod_without_toleration_is_kept_off_the_gpu_node(
    cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apps.create_namespaced_deployment(namespace, deployment("untolerated", gpus=1))

    pods = wait_for(
        "the scheduler to reject the untolerating GPU pod",
        lambda: pods_of(cluster, namespace, "untolerated"),
        lambda pods: len(pods) == 1 and condition(pods[0], "PodScheduled") is not None,
        timeout_s=60,
    )
    scheduled = condition(pods[0], "PodScheduled")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    # The CPU node has no GPUs; the GPU node has them but carries a taint the pod lacks.
    assert scheduled["message"].startswith(
        f"0/2 nodes are available: 1 Insufficient {GPU_RESOURCE}, "
        "1 node(s) had untolerated taint(s)."
    )


def test_deleting_a_deployment_garbage_collects_replicaset_and_pods(
    cluster: ClusterHandle, namespace: str
) -> None:
    created = cluster.json(
        cluster.apps.create_namespaced_deployment(namespace, deployment("web", replicas=2))
    )
    pods = wait_for(
        "two Running pods on the CPU node",
        lambda: pods_of(cluster, namespace, "web"),
        lambda pods: len(pods) == 2 and all(phase(p) == "Running" for p in pods),
        timeout_s=60,
    )
    assert {p["spec"]["nodeName"] for p in pods} == {CPU_NODE}
    (replicaset,) = replicasets_of(cluster, namespace, "web")
    (owner,) = replicaset["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Deployment",
        "web",
        created["metadata"]["uid"],
    )
    pod_owners = {p["metadata"]["ownerReferences"][0]["uid"] for p in pods}
    assert pod_owners == {replicaset["metadata"]["uid"]}

    cluster.apps.delete_namespaced_deployment("web", namespace, propagation_policy="Background")

    wait_for(
        "the garbage collector to delete the ReplicaSet",
        lambda: replicasets_of(cluster, namespace, "web"),
        lambda items: items == [],
        timeout_s=60,
    )
    wait_for(
        "the pods to be deleted",
        lambda: pods_of(cluster, namespace, "web"),
        lambda items: items == [],
        timeout_s=60,
    )


def test_hpa_v2_with_pods_and_resource_metrics_is_processed(
    cluster: ClusterHandle, namespace: str
) -> None:
    cluster.apps.create_namespaced_deployment(namespace, deployment("engine"))
    hpa: Any = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "engine"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "engine"},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "quire_kv_cache_utilization"},
                        "target": {"type": "AverageValue", "averageValue": "800m"},
                    },
                },
                {
                    "type": "Resource",
                    "resource": {
                        "name": "cpu",
                        "target": {"type": "Utilization", "averageUtilization": 80},
                    },
                },
            ],
        },
    }
    created = cluster.autoscaling.create_namespaced_horizontal_pod_autoscaler(namespace, hpa)
    # autoscaling/v2 is the storage version, so the spec round-trips unchanged.
    assert cluster.json(created)["spec"] == hpa["spec"]

    def conditions() -> dict[str, tuple[str, str]]:
        read = cluster.autoscaling.read_namespaced_horizontal_pod_autoscaler_status
        status = cluster.json(read("engine", namespace))["status"]
        return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions", [])}

    seen = wait_for(
        "the HPA controller to report conditions",
        conditions,
        lambda conds: {"AbleToScale", "ScalingActive"} <= conds.keys(),
        timeout_s=60,
    )
    # It read the Deployment's scale subresource; it cannot compute metrics because this
    # cluster serves no metrics APIs, and says so for the first metric in the spec.
    assert seen["AbleToScale"] == ("True", "SucceededGetScale")
    assert seen["ScalingActive"] == ("False", "FailedGetPodsMetric")


CRD_GROUP = "test.quire.dev"


def widget_crd(plural: str) -> Any:
    spec_schema = {
        "type": "object",
        "required": ["minReplicas", "maxReplicas"],
        "properties": {
            "minReplicas": {"type": "integer", "minimum": 0},
            "maxReplicas": {"type": "integer", "minimum": 1},
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.minReplicas <= self.maxReplicas",
                "message": "minReplicas must not exceed maxReplicas",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{CRD_GROUP}"},
        "spec": {
            "group": CRD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": spec_schema},
                        }
                    },
                }
            ],
        },
    }


def test_crd_structural_schema_and_cel_rule(cluster: ClusterHandle, namespace: str) -> None:
    # A unique plural so reruns against a long-lived `up` cluster never collide.
    plural = f"widgets{uuid.uuid4().hex[:6]}s"
    name = f"{plural}.{CRD_GROUP}"
    cluster.apiextensions.create_custom_resource_definition(widget_crd(plural))
    try:
        wait_for(
            "the CRD to be Established",
            lambda: cluster.json(cluster.apiextensions.read_custom_resource_definition(name)),
            lambda crd: (condition(crd, "Established") or {}).get("status") == "True",
            timeout_s=30,
        )

        def create(name: str, spec: dict[str, Any]) -> Any:
            body = {"apiVersion": f"{CRD_GROUP}/v1", "kind": "Widget", "metadata": {"name": name},
                    "spec": spec}  # fmt: skip
            return cluster.custom.create_namespaced_custom_object(
                CRD_GROUP, "v1", namespace, plural, body
            )

        good = create("good", {"minReplicas": 1, "maxReplicas": 3, "unknownField": "x"})
        # Structural schema: the API server prunes fields the schema does not declare.
        assert good["spec"] == {"minReplicas": 1, "maxReplicas": 3}

        def rejection(name: str, spec: dict[str, Any]) -> str:
            with pytest.raises(ApiException) as rejected:
                create(name, spec)
            assert rejected.value.status == 422
            message: str = json.loads(str(rejected.value.body))["message"]
            return message

        # The CEL rule, with the message the CRD declares, as the API server words it.
        assert rejection("bad", {"minReplicas": 5, "maxReplicas": 2}) == (
            f'Widget.{CRD_GROUP} "bad" is invalid: spec: Invalid value: '
            "minReplicas must not exceed maxReplicas"
        )
        # The schema's types and bounds are enforced too, and CEL is skipped on such objects.
        # The API server lists the field errors in no fixed order: compare them as a set.
        message = rejection("typed", {"minReplicas": -1, "maxReplicas": "ten"})
        prefix = f'Widget.{CRD_GROUP} "typed" is invalid: ['
        assert message.startswith(prefix) and message.endswith("]")
        assert set(message[len(prefix) : -1].split(", ")) == {
            'spec.maxReplicas: Invalid value: "string": '
            'spec.maxReplicas in body must be of type integer: "string"',
            "spec.minReplicas: Invalid value: -1: "
            "spec.minReplicas in body should be greater than or equal to 0",
            "<nil>: Invalid value: null: some validation rules were not checked because the "
            "object was invalid; correct the existing errors to complete validation",
        }
    finally:
        cluster.apiextensions.delete_custom_resource_definition(name)


def test_kubectl_and_helm_run_from_the_cache(cluster: ClusterHandle) -> None:
    kubectl = cluster.kubectl("version", "--output=json")
    assert kubectl.returncode == 0, kubectl.stderr
    versions = json.loads(kubectl.stdout)
    assert versions["clientVersion"]["gitVersion"] == K8S_VERSION
    assert versions["serverVersion"]["gitVersion"] == K8S_VERSION

    nodes = cluster.kubectl("get", "nodes", "--output=name")
    assert nodes.returncode == 0, nodes.stderr
    assert sorted(nodes.stdout.split()) == sorted([f"node/{CPU_NODE}", f"node/{GPU_NODE}"])

    helm = cluster.helm("version", "--short")
    assert helm.returncode == 0, helm.stderr
    assert helm.stdout == f"{HELM_VERSION}\n"
    # helm reaches the API server through the same kubeconfig.
    releases = cluster.helm("list", "--all-namespaces", "--output=json")
    assert releases.returncode == 0, releases.stderr
    assert json.loads(releases.stdout) == []

    # KUBEBUILDER_ASSETS may legitimately point kubectl elsewhere; otherwise it is the cache's.
    if not os.environ.get("KUBEBUILDER_ASSETS"):
        assert cluster.binaries.kubectl.is_relative_to(cache_root())
        assert cluster.binaries.helm.is_relative_to(cache_root())


def test_warm_startup_is_well_under_a_minute(cluster: ClusterHandle) -> None:
    # Measured by the launcher from the first process start to Ready nodes and a working
    # controller manager; the binaries' build time is not part of it.
    assert 0 < cluster.control_plane.startup_s < 60
