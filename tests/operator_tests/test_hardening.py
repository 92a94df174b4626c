"""Operator hardening (issue 12) against the real control plane: ownership, Events, pod security.

- An object of a child's name that the InferenceService does not control is never applied over
  or adopted: Degraded=NotOwned names it, one Warning Event says so however often the requeue
  retries, and the service converges by itself once the object is gone.
- An apply names the uid of the object it found ours, so a replacement is never written.
- Engine pods are admitted in a namespace that enforces the "restricted" Pod Security Standard
  (the API server's PodSecurity admission, on by default), with a read-only root, no service
  account token, the API key from a Secret and the drain wiring as the API server stores it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.builders.service import build_service
from quire_operator.children import Children
from quire_operator.spec.parsing import parse
from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.api import (
    NAME,
    condition,
    create_isvc,
    deployment,
    events,
    ready,
    service,
    wait_condition,
)
from tests.operator_tests.helpers import inference_service, load_example
from tests.operator_tests.operator_process import Operators

pytestmark = pytest.mark.cluster


def test_a_foreign_object_is_left_alone_reported_and_waited_out(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    # Someone else's Service already has the name (helm, a person, another tool).
    foreign = {
        "metadata": {"name": NAME, "labels": {"app": "someone-elses"}},
        "spec": {"selector": {"app": "someone-elses"}, "ports": [{"port": 80}]},
    }
    before = cluster.json(cluster.core.create_namespaced_service(namespace, foreign))  # type: ignore[arg-type]  # dict body: the client validates it
    process = operators.start()
    create_isvc(cluster, namespace, load_example())

    isvc = wait_condition(cluster, namespace, "Degraded", reason="NotOwned")
    message = condition(isvc, "Degraded")["message"]
    assert message.startswith(
        f'Service "{NAME}" already exists and is not controlled by this InferenceService'
    ), message
    assert condition(isvc, "Ready")["reason"] == "NotOwned"
    # Retried with backoff meanwhile, and nothing was applied: no Deployment, and the Service
    # is exactly as its owner left it (no owner reference, no field of ours).
    process.wait_for_log(rf"{namespace}/{NAME}: retry 3 in ", timeout_s=30)
    assert deployment(cluster, namespace) is None
    after = service(cluster, namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    managers = {m["manager"] for m in after["metadata"]["managedFields"]}
    assert meta.FIELD_MANAGER not in managers
    # However many retries, one Event for the transition.
    assert events(cluster, namespace) == [("Warning", "NotOwned")]

    cluster.core.delete_namespaced_service(NAME, namespace)
    isvc = ready(cluster, namespace)  # the requeue's next retry finds the name free
    assert condition(isvc, "Degraded")["reason"] == "AsExpected"
    ours = service(cluster, namespace)
    assert ours["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert wait_for(
        "the recovery Events",
        lambda: events(cluster, namespace),
        lambda found: len(found) >= 4,
    ) == [
        ("Normal", "Applied"),
        ("Normal", "Ready"),
        ("Normal", "Recovered"),
        ("Warning", "NotOwned"),
    ]


def test_a_look_alike_deployment_is_not_adopted(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    # Worst case: labelled exactly like the operator's own (so its events reach the operator),
    # e.g. left behind by `kubectl delete --cascade=orphan` of an earlier InferenceService.
    labels = meta.labels(NAME)
    orphan = {
        "metadata": {"name": NAME, "labels": labels},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": meta.selector_labels(NAME)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "old", "image": "old-engine:1"}]},
            },
        },
    }
    cluster.apps.create_namespaced_deployment(namespace, orphan)  # type: ignore[arg-type]  # dict body: the client validates it
    operators.start()
    create_isvc(cluster, namespace, load_example())
    wait_condition(cluster, namespace, "Degraded", reason="NotOwned")
    live = deployment(cluster, namespace)
    assert "ownerReferences" not in live["metadata"]  # the garbage collector can never take it
    assert [c["image"] for c in live["spec"]["template"]["spec"]["containers"]] == ["old-engine:1"]
    # The Service, HPA and PDB are not applied either: an HPA would scale someone else's pods.
    assert service(cluster, namespace) is None


def test_engine_pods_meet_the_restricted_pod_security_standard(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    restricted = {"pod-security.kubernetes.io/enforce": "restricted"}
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": restricted}})
    # The namespace really enforces it: a pod without the restricted settings is refused.
    with pytest.raises(ApiException) as refused:
        bare = {"metadata": {"name": "bare"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
        cluster.core.create_namespaced_pod(namespace, bare)  # type: ignore[arg-type]  # dict body: the client validates it
    assert refused.value.status == 403
    refusal = json.loads(str(refused.value.body))
    assert 'violates PodSecurity "restricted:latest"' in refusal["message"]

    operators.start()
    spec: dict[str, Any] = {
        "model": {"uri": "hf://org/model", "hfTokenSecretRef": {"name": "hf"}},
        "engine": {"shutdownTimeoutSeconds": 90, "preStopDelaySeconds": 15},
        "resources": {"gpus": 0, "sharedMemory": "2Gi"},
        "apiKeySecretRef": {"name": "llm-key"},
    }
    create_isvc(cluster, namespace, {**load_example(), "spec": spec})
    isvc = ready(cluster, namespace)  # its pod was admitted, scheduled and runs
    assert isvc["status"]["auth"] == "APIKey"
    table = cluster.kubectl("get", "qis", NAME, "-n", namespace)
    header, row = (line.split() for line in table.stdout.splitlines())
    assert row[header.index("AUTH")] == "APIKey"

    (pod,) = cluster.json(
        cluster.core.list_namespaced_pod(namespace, label_selector=meta.selector_string(NAME))
    )["items"]
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    # No projected service-account token volume was injected.
    assert sorted(v["name"] for v in spec["volumes"]) == ["dshm", "home", "model", "tmp"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in spec["volumes"]
    (engine,) = spec["containers"]
    for container in [engine, *spec["initContainers"]]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp", "/home/quire"}
    # The drain wiring as the API server admitted it (the kubelet's own sleep action).
    assert engine["lifecycle"] == {"preStop": {"sleep": {"seconds": 15}}}
    assert spec["terminationGracePeriodSeconds"] == 15 + 90 + 5
    assert engine["args"][engine["args"].index("--shutdown-timeout") + 1] == "90"
    # The API key only as a Secret reference: never in args, the spec or annotations.
    key_ref = {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}
    assert engine["env"] == [{"name": "QUIRE_API_KEY", "valueFrom": key_ref}]
    assert not [a for a in engine["args"] if "api-key" in a]


def test_an_apply_naming_a_uid_never_writes_a_replacement(
    cluster: ClusterHandle, namespace: str
) -> None:
    # The reconciler found the Service ours (uid A); before its apply, someone deleted it and
    # made their own (uid B). The apply names A, so the API server refuses it.
    isvc = parse(inference_service(load_example()["spec"], name=NAME, namespace=namespace))
    theirs = {"metadata": {"name": NAME}, "spec": {"ports": [{"port": 80}]}}
    replacement = cluster.json(cluster.core.create_namespaced_service(namespace, theirs))  # type: ignore[arg-type]  # dict body: the client validates it
    children = Children(cluster.api)
    with pytest.raises(ApiException) as refused:
        children.apply(build_service(isvc), uid="0b5c8a5e-0000-4000-8000-000000000000")
    assert refused.value.status == 409  # retried by the requeue, which then reports NotOwned
    after = service(cluster, namespace)
    assert after["metadata"]["resourceVersion"] == replacement["metadata"]["resourceVersion"]
    # Gone meanwhile: not re-created either.
    cluster.core.delete_namespaced_service(NAME, namespace)
    with pytest.raises(ApiException) as refused:
        children.apply(build_service(isvc), uid=replacement["metadata"]["uid"])
    assert refused.value.status == 409
    assert service(cluster, namespace) is None
