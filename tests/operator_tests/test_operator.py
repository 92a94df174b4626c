"""Acceptance tests of the operator (issue 6) against the real control plane of tests/cluster.

Every test runs real ``quire-operator`` processes (tests/operator_tests/operator_process.py)
against the real API server, controller manager (Deployment, ReplicaSet, HPA, garbage collector)
and kwok nodes; nothing of the Kubernetes API is mocked. Waits are bounded (``wait_for``) and
assertions are on exact values. The expected children are the pure builders' output for the object
as the API server stored it, so these tests prove that what the builders say is what the cluster
gets.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.builders.deployment import build_deployment
from quire_operator.builders.disruption_budget import build_pdb
from quire_operator.builders.hpa import build_hpa
from quire_operator.builders.service import build_service
from quire_operator.config import OperatorConfig
from quire_operator.spec.parsing import parse
from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.nodes import GPU_NODE
from tests.operator_tests.api import (
    MERGE,
    NAME,
    assert_applied,
    condition,
    create_example,
    create_isvc,
    deployment,
    engine_args,
    events,
    flag,
    get_isvc,
    hpa,
    operator_apply_fields,
    patch_spec,
    pdb,
    ready,
    service,
    wait_condition,
)
from tests.operator_tests.helpers import EXAMPLE_PATH, load_example, root_schema, with_defaults
from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators

pytestmark = pytest.mark.cluster
# Drift must be repaired "within seconds": the operator reacts to the watch event itself.
REPAIR_S = 10


# --- the acceptance tests ---


def test_readme_example_reconciles_to_ready_children(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    operators.start("--all-namespaces")
    applied = cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE_PATH))
    assert applied.returncode == 0, applied.stderr
    isvc = ready(cluster, namespace)

    # The API server defaulted the spec exactly as the unit tests' helper does.
    assert isvc["spec"] == with_defaults(load_example(), root_schema())["spec"]
    parsed = parse(isvc)
    uid = isvc["metadata"]["uid"]

    live = deployment(cluster, namespace)
    assert_applied(live, build_deployment(parsed, OperatorConfig()))
    assert live["metadata"]["ownerReferences"][0]["uid"] == uid
    container = live["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
    assert flag(live, "--model") == "tiny"
    assert flag(live, "--block-size") == "16"
    # Autoscaling is on: the Deployment's replicas are the HPA's, not the operator's.
    assert "f:replicas" not in operator_apply_fields(live)["f:spec"]

    assert_applied(service(cluster, namespace), build_service(parsed))
    # autoscaling/v2 is the storage version: the HPA's spec is exactly what was applied.
    wanted_hpa = build_hpa(parsed)
    assert wanted_hpa is not None
    assert hpa(cluster, namespace)["spec"] == wanted_hpa["spec"]
    assert [m["pods"]["metric"]["name"] for m in wanted_hpa["spec"]["metrics"]] == [
        "quire_kv_cache_usage_ratio",
        "quire_num_requests_waiting",
    ]
    wanted_pdb = build_pdb(parsed)  # up to 4 replicas: one voluntary disruption at a time
    assert wanted_pdb is not None
    assert_applied(pdb(cluster, namespace), wanted_pdb)

    pods = cluster.json(
        cluster.core.list_namespaced_pod(namespace, label_selector=meta.selector_string(NAME))
    )["items"]
    assert [(p["status"]["phase"], p["spec"]["nodeName"]) for p in pods] == [("Running", GPU_NODE)]
    # The API server copies an extended resource's limit into the pod's requests.
    assert pods[0]["spec"]["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": "1"},
        "requests": {"nvidia.com/gpu": "1"},
    }

    url = f"http://{NAME}.{namespace}.svc.cluster.local:8000"
    status = isvc["status"]
    assert (status["replicas"], status["readyReplicas"], status["url"]) == (1, 1, url)
    assert status["selector"] == meta.selector_string(NAME)
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "True", "ReplicasReady"),
        ("Progressing", "False", "RolloutComplete"),
        ("Degraded", "False", "AsExpected"),
    ]

    table = cluster.kubectl("get", "qis", "-n", namespace)
    assert table.returncode == 0, table.stderr
    header, row = (line.split() for line in table.stdout.splitlines())
    assert header == ["NAME", "READY", "REPLICAS", "DESIRED", "URL", "AUTH", "AGE"]
    assert row[:6] == [NAME, "True", "1", "1", url, "None"]


def test_spec_update_is_followed_and_observed_generation_advances(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    operators.start()
    create_example(cluster, namespace)

    autoscaling = {
        "targetKVCacheUtilization": 0.6,
        "targetQueueDepth": None,  # merge patch: remove this target
        "targetPreemptionRate": 0.5,
    }
    patched = patch_spec(
        cluster,
        namespace,
        {"engine": {"blockSize": 32}, "resources": {"gpus": 2}, "autoscaling": autoscaling},
    )
    assert patched["metadata"]["generation"] == 2
    isvc = ready(cluster, namespace, generation=2)
    assert condition(isvc, "Ready")["observedGeneration"] == 2

    live = deployment(cluster, namespace)
    assert flag(live, "--block-size") == "32"
    limits = live["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "2"}
    assert [
        (m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"])
        for m in hpa(cluster, namespace)["spec"]["metrics"]
    ] == [("quire_kv_cache_usage_ratio", "600m"), ("quire_preemptions_per_second", "500m")]
    # The rollout finished: the one pod left runs the new template.
    pods = wait_for(
        "only the new pod",
        lambda: cluster.json(
            cluster.core.list_namespaced_pod(namespace, label_selector=meta.selector_string(NAME))
        )["items"],
        lambda pods: len(pods) == 1,
        timeout_s=60,
    )
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}


def test_hpa_owns_replicas_when_autoscaling_and_the_spec_otherwise(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    operators.start()
    create_example(cluster, namespace)

    # Scale the way the HPA controller does: through the scale subresource, as another manager.
    cluster.apps.patch_namespaced_deployment_scale(
        NAME, namespace, {"spec": {"replicas": 3}}, field_manager="hpa", _content_type=MERGE
    )
    # The status shows 3 ready replicas only after the operator reconciled on that change...
    wait_for(
        "status with 3 ready replicas",
        lambda: get_isvc(cluster, namespace)["status"],
        lambda status: status["replicas"] == status["readyReplicas"] == 3,
        timeout_s=60,
    )
    # ...and having done so, it left the scaling decision alone, and said so once.
    live = deployment(cluster, namespace)
    assert live["spec"]["replicas"] == 3
    scaled = [e for e in events(cluster, namespace) if e[1] == "Scaled"]
    assert scaled == [("Normal", "Scaled")]
    assert "f:replicas" not in operator_apply_fields(live)["f:spec"]

    patch_spec(cluster, namespace, {"autoscaling": {"enabled": False}, "replicas": 2})
    wait_for("the HPA deleted", lambda: hpa(cluster, namespace), lambda h: h is None, timeout_s=30)
    live = wait_for(
        "spec.replicas enforced",
        lambda: deployment(cluster, namespace),
        lambda d: d["spec"]["replicas"] == 2,
        timeout_s=30,
    )
    assert "f:replicas" in operator_apply_fields(live)["f:spec"]

    # Someone scales by hand: the operator takes the field back.
    by_hand = cluster.kubectl("scale", "deployment", NAME, "-n", namespace, "--replicas=5")
    assert by_hand.returncode == 0, by_hand.stderr
    wait_for(
        "replicas back at 2",
        lambda: deployment(cluster, namespace),
        lambda d: (
            d["metadata"]["generation"] > live["metadata"]["generation"]
            and d["spec"]["replicas"] == 2
        ),
        timeout_s=REPAIR_S,
    )
    assert pdb(cluster, namespace) is not None  # 2 replicas: a budget
    patch_spec(cluster, namespace, {"replicas": 1})
    wait_for("the PDB deleted", lambda: pdb(cluster, namespace), lambda p: p is None, timeout_s=30)


def test_drift_is_repaired_within_seconds(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    operators.start()
    create_example(cluster, namespace)
    wanted_args = engine_args(deployment(cluster, namespace))
    old_service = service(cluster, namespace)

    cluster.core.delete_namespaced_service(NAME, namespace)
    restored = wait_for(
        "the Service recreated",
        lambda: service(cluster, namespace),
        lambda s: s is not None and s["metadata"]["uid"] != old_service["metadata"]["uid"],
        timeout_s=REPAIR_S,
    )
    assert restored["spec"]["ports"] == old_service["spec"]["ports"]

    edit = [
        {"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": ["serve"]},
    ]
    cluster.apps.patch_namespaced_deployment(
        NAME, namespace, edit, _content_type="application/json-patch+json"
    )
    wait_for(
        "the container args restored",
        lambda: deployment(cluster, namespace),
        lambda d: engine_args(d) == wanted_args,
        timeout_s=REPAIR_S,
    )

    cluster.autoscaling.delete_namespaced_horizontal_pod_autoscaler(NAME, namespace)
    wait_for(
        "the HPA recreated", lambda: hpa(cluster, namespace), lambda h: h is not None, timeout_s=10
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2,
                             "targetQueueDepth": 4}},
            "spec.autoscaling: Invalid value: minReplicas must not exceed maxReplicas",
        ),
        (
            {"engine": {"blockSize": 24}},
            "spec.engine.blockSize: Invalid value: 24: "
            "blockSize must be a power of two from 1 to 256",
        ),
        (
            {"engine": {"gpuMemoryUtilization": 1.5}},
            "spec.engine.gpuMemoryUtilization: Invalid value: 1.5: "
            "spec.engine.gpuMemoryUtilization in body should be less than or equal to 1",
        ),
        (
            {"engine": {"preemptionMode": "evict"}},
            'spec.engine.preemptionMode: Unsupported value: "evict": '
            'supported values: "recompute", "swap"',
        ),
        (
            {"engine": {"extraArgs": ["--port=9000"]}},
            "spec.engine.extraArgs: Invalid value: extraArgs must not repeat flags the operator "
            "sets from the spec",
        ),
        (
            {"engine": {"extraArgs": ["--api-key", "hunter2"]}},
            "or carry an API key (--api-key: use spec.apiKeySecretRef)",
        ),
        (
            {"resources": {"gpus": 2}, "parallelism": {"tensor": 4}},
            "spec.resources.gpus must equal spec.parallelism.tensor: each tensor-parallel rank "
            "of a pod uses one GPU",
        ),
        (
            {"engine": {"extraArgs": ["--nnodes=2"]}},
            "--[no-]headless: use spec.parallelism",
        ),
        (
            {"engine": {"extraArgs": ["--lora-modules", "a=/a"]}},
            "--lora-dir, --[no-]allow-runtime-lora-updating: use spec.lora",
        ),
        (
            {"lora": {"maxLoraRank": 8,
                      "adapters": [{"name": "a", "uri": "file:///a", "rank": 16}]}},
            "spec.lora: Invalid value: an adapter's rank must not exceed maxLoraRank",
        ),
        (
            {"lora": {"adapters": [{"name": "a", "uri": "s3://bucket/a"}]}},
            "uri must be hf://org/name, pvc://claim or pvc://claim/path, or file:///path",
        ),
        (
            {"lora": {"adapters": [{"name": "a", "uri": "file:///a"},
                                   {"name": "a", "uri": "file:///b"}]}},
            'spec.lora.adapters[1]: Duplicate value: {"name":"a"}',
        ),
    ],
    ids=[
        "min-above-max",
        "block-size-24",
        "gpu-memory-1.5",
        "unknown-preemption",
        "extra-port",
        "extra-api-key",
        "unused-gpus",
        "extra-nnodes",
        "extra-lora-modules",
        "lora-rank-above-max",
        "lora-uri",
        "lora-duplicate-name",
    ],
)  # fmt: skip
def test_invalid_specs_are_rejected_by_the_api_server(
    cluster: ClusterHandle,
    crds: GarbageCollectorProbe,
    namespace: str,
    spec: dict[str, Any],
    message: str,
) -> None:
    body = {**load_example(), "metadata": {"name": "bad"}}
    body["spec"] = {**body["spec"], **spec}
    with pytest.raises(ApiException) as rejected:
        create_isvc(cluster, namespace, body)
    assert rejected.value.status == 422
    text = json.loads(str(rejected.value.body))["message"]
    assert text.startswith('InferenceService.quire.dev "bad" is invalid: '), text
    assert message in text, text


def test_a_missing_secret_degrades_with_the_kubelets_words_and_no_secret_is_read(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    operators.start()
    model = {"uri": "hf://org/gated-model", "hfTokenSecretRef": {"name": "hf-token"}}
    spec = {"model": model, "apiKeySecretRef": {"name": "llm-key"}}
    create_isvc(cluster, namespace, {**load_example(), "spec": spec})
    # The operator reads no Secret (it may not): the Deployment is made at once, naming them.
    isvc = ready(cluster, namespace)
    assert isvc["status"]["auth"] == "APIKey"
    pod_spec = deployment(cluster, namespace)["spec"]["template"]["spec"]
    token = {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    assert token in pod_spec["initContainers"][0]["env"]

    # The kubelet's report when the engine container restarts and the Secret is gone (kwok
    # plays a kubelet that does not check Secrets, so the test writes it as the kubelet would).
    (pod,) = cluster.json(
        cluster.core.list_namespaced_pod(namespace, label_selector=meta.selector_string(NAME))
    )["items"]
    message = 'secret "llm-key" not found'
    waiting = {"reason": "CreateContainerConfigError", "message": message}
    kubelet_status = {
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False"},
                           {"type": "ContainersReady", "status": "False"}],
            "containerStatuses": [
                {"name": "engine", "image": pod["spec"]["containers"][0]["image"], "imageID": "",
                 "ready": False, "restartCount": 1, "state": {"waiting": waiting}},
            ],
        }
    }  # fmt: skip
    cluster.core.patch_namespaced_pod_status(pod["metadata"]["name"], namespace, kubelet_status)
    isvc = wait_condition(cluster, namespace, "Degraded", reason="CreateContainerConfigError")
    where = f"pod {pod['metadata']['name']}, container engine"
    assert condition(isvc, "Degraded")["message"] == f"{where}: {message}"
    assert condition(isvc, "Ready")["reason"] == "NoReplicaReady"


def test_unschedulable_replicas_degrade_with_the_schedulers_reason(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    operators.start()
    create_example(cluster, namespace)

    patch_spec(cluster, namespace, {"resources": {"gpus": 16}})  # no node has 16
    isvc = wait_condition(cluster, namespace, "Degraded", reason="Unschedulable")
    message = condition(isvc, "Degraded")["message"]
    unschedulable = r"pod tiny-[a-z0-9]+-[a-z0-9]+: 0/2 nodes are available: 2 Insufficient nvidia"
    assert re.match(unschedulable, message), message
    # The old replica keeps serving while the new one cannot be placed.
    assert condition(isvc, "Ready")["status"] == "True"
    assert condition(isvc, "Progressing")["reason"] == "RollingOut"

    patch_spec(cluster, namespace, {"resources": {"gpus": 1}})
    isvc = ready(cluster, namespace, generation=3)
    assert condition(isvc, "Degraded")["reason"] == "AsExpected"


def test_operator_restart_mid_way_converges(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    # The worst case for the replacement: a lower priority than the crashed process, whose
    # keep-alive must lapse first (a short --peering-lifetime keeps that to seconds).
    first = operators.start("--priority", "10", "--peering-lifetime", "6", name="first")
    create_example(cluster, namespace)

    patch_spec(cluster, namespace, {"engine": {"blockSize": 64}})
    first.kill()  # mid-way: the change may or may not have been handled
    cluster.core.delete_namespaced_service(NAME, namespace)  # and drift while nobody watches

    operators.start("--priority", "5", name="second")
    ready(cluster, namespace, generation=2)
    assert flag(deployment(cluster, namespace), "--block-size") == "64"
    wait_for("the Service back", lambda: service(cluster, namespace), lambda s: s is not None)


def test_two_operators_do_not_fight(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    # A resync every second, so the standby would show it if it did not honour the peering.
    resync = ("--resync-seconds", "1")
    active = operators.start("--priority", "20", *resync, name="active")
    standby = operators.start("--priority", "10", *resync, name="standby")
    # Both keep-alives are in the peering object; the lower priority one stays paused (kopf
    # starts a peered operator paused and logs nothing until it resumes).
    wait_for(
        "both operators in the peering object",
        lambda: cluster.json(
            cluster.custom.get_namespaced_custom_object(
                "kopf.dev", "v1", namespace, "kopfpeerings", "quire-operator"
            )
        ).get("status", {}),
        lambda peers: sorted(p["priority"] for p in peers.values()) == [10, 20],
        timeout_s=30,
    )

    create_example(cluster, namespace)
    patch_spec(cluster, namespace, {"engine": {"blockSize": 32}})
    ready(cluster, namespace, generation=2)
    done = f"{namespace}/{NAME}: reconciled generation"
    active.wait_for_log(f"{done} 2")
    assert done not in standby.log()
    active.wait_for_log(r"resync: reconciling 1 InferenceService")
    assert "resync:" not in standby.log()  # its requeue thread asks the peering object too

    # One manager applied the Deployment, and its spec stays put: no tug of war (generation
    # moves with every spec write; the controllers' status writes do not count).
    live = deployment(cluster, namespace)
    managed = live["metadata"]["managedFields"]
    assert {m["manager"] for m in managed if m["operation"] == "Apply"} == {meta.FIELD_MANAGER}
    # Three more resync passes (what 3 s held at --resync-seconds 1), each re-applying the spec:
    # a pass logs as it starts, so a fourth start means three have finished.
    resyncs = active.log().count("resync: reconciling")
    wait_for(
        "three more resync passes of the active operator",
        lambda: active.log().count("resync: reconciling"),
        lambda seen: seen >= resyncs + 4,
        timeout_s=30,
    )
    assert (
        deployment(cluster, namespace)["metadata"]["generation"] == live["metadata"]["generation"]
    )

    active.stop()  # leaves the peering object on the way out; the standby takes over
    standby.wait_for_log(r"Resuming operations")
    patch_spec(cluster, namespace, {"engine": {"blockSize": 64}})
    ready(cluster, namespace, generation=3)
    assert flag(deployment(cluster, namespace), "--block-size") == "64"
    standby.wait_for_log(f"{done} 3")
    standby.wait_for_log(r"resync: reconciling 1 InferenceService")


# Last in the file: by now the garbage collector has long discovered the new CRD (see crds).
def test_deleting_the_inference_service_garbage_collects_everything(
    cluster: ClusterHandle, namespace: str, operators: Operators, crds: GarbageCollectorProbe
) -> None:
    operator = operators.start()
    create_example(cluster, namespace)
    crds.wait()  # a cluster where the CRD is older than the GC's discovery period
    assert get_isvc(cluster, namespace)["metadata"].get("finalizers") is None
    selector = meta.selector_string(NAME)

    def remaining() -> dict[str, int]:
        from kubernetes import client

        lists = {
            "deployments": cluster.apps.list_namespaced_deployment,
            "replicasets": cluster.apps.list_namespaced_replica_set,
            "pods": cluster.core.list_namespaced_pod,
            "services": cluster.core.list_namespaced_service,
            "hpas": cluster.autoscaling.list_namespaced_horizontal_pod_autoscaler,
            "pdbs": client.PolicyV1Api(cluster.api).list_namespaced_pod_disruption_budget,
        }
        counts = {
            kind: len(cluster.json(ls(namespace, label_selector=selector))["items"])
            for kind, ls in lists.items()
        }
        return {kind: count for kind, count in counts.items() if count}

    assert remaining() == {
        "deployments": 1,
        "replicasets": 1,
        "pods": 1,
        "services": 1,
        "hpas": 1,
        "pdbs": 1,
    }
    # Stopped first: deletion must need nothing from the operator, only owner references and
    # the garbage collector.
    operator.stop()
    cluster.custom.delete_namespaced_custom_object(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, NAME
    )
    wait_for("everything garbage-collected", remaining, lambda left: left == {}, timeout_s=60)
