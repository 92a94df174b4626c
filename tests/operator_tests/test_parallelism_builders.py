"""Unit tests of ``spec.parallelism``: its defaults and refusals, the engine flags it sets, and
the LeaderWorkerSet that replaces the Deployment above one node (with the Service, InferencePool
and autoscalers pointed at it). Exact objects, no cluster."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from quire_operator.builders.autoscaling import build_scaled_object, pod_matchers
from quire_operator.builders.deployment import build_deployment
from quire_operator.builders.hpa import build_hpa
from quire_operator.builders.inference_pool import build_inference_pool
from quire_operator.builders.leader_worker_set import build_leader_worker_set
from quire_operator.builders.service import build_service
from quire_operator.config import OperatorConfig
from quire_operator.spec.view import Parallelism
from tests.operator_tests.test_builders import LABELS, METADATA, SELECTOR, example_args, isvc

CONFIG = OperatorConfig(prometheus_address="http://prometheus:9090")
LEADERS = {**SELECTOR, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
SHAPE = ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-port", "29500"]
AUTOSCALING = {
    "enabled": True,
    "minReplicas": 1,
    "maxReplicas": 3,
    "targetKVCacheUtilization": 0.8,
}


def _args(service: Any) -> list[str]:
    deployment = build_deployment(service, CONFIG)
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_tensor_defaults_to_the_pods_gpus_and_nodes_to_one() -> None:
    assert isvc().parallelism == Parallelism(tensor=1, nodes=1)
    assert isvc(resources={"gpus": 4}).parallelism == Parallelism(tensor=4, nodes=1)
    assert isvc(resources={"gpus": 0}).parallelism == Parallelism(tensor=1, nodes=1)
    assert _args(isvc()) == example_args()  # one rank: no parallelism flag at all


def test_a_multi_gpu_pod_shards_over_all_its_gpus() -> None:
    args = _args(isvc(resources={"gpus": 4}))
    assert args == [*example_args(), "--tensor-parallel-size", "4"]


def test_cpu_pods_may_shard_too() -> None:
    service = isvc(resources={"gpus": 0}, parallelism={"tensor": 2})
    args = _args(service)
    assert args[args.index("--device") + 1] == "cpu"
    assert args[-2:] == ["--tensor-parallel-size", "2"]


def test_gpus_the_parallelism_does_not_use_are_refused() -> None:
    with pytest.raises(ValueError, match=r"resources\.gpus is 4 but parallelism\.tensor is 2"):
        isvc(resources={"gpus": 4}, parallelism={"tensor": 2})
    with pytest.raises(ValueError, match=r"parallelism.tensor and nodes must be >= 1; got 1, 0"):
        Parallelism(nodes=0)


def test_one_node_keeps_the_deployment_and_its_selectors() -> None:
    service = isvc(resources={"gpus": 2})
    assert build_service(service)["spec"]["selector"] == SELECTOR
    hpa = build_hpa(isvc(resources={"gpus": 2}, autoscaling=AUTOSCALING))
    assert hpa is not None
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny"}
    assert hpa["spec"]["scaleTargetRef"] == target


def test_several_nodes_make_a_leader_worker_set_of_the_deployments_pod() -> None:
    service = isvc(
        resources={"gpus": 2}, parallelism={"nodes": 2}, replicas=3, autoscaling={"enabled": False}
    )
    pod = build_deployment(service, CONFIG)["spec"]["template"]
    leader = copy.deepcopy(pod)
    (engine,) = leader["spec"]["containers"]
    assert engine["args"] == [*example_args(), *SHAPE]
    engine["ports"].append({"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"})
    worker_spec = copy.deepcopy(pod["spec"])
    (worker,) = worker_spec["containers"]
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
        del worker[key]
    worker["args"] = [
        *example_args(), *SHAPE,
        "--headless", "--node-rank", "$(LWS_WORKER_INDEX)",
        "--master-addr", "$(LWS_LEADER_ADDRESS)",
    ]  # fmt: skip
    assert build_leader_worker_set(service, CONFIG) == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": METADATA,
        "spec": {
            "replicas": 3,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "leaderWorkerTemplate": {
                "size": 2,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": {"metadata": {"labels": LABELS}, "spec": worker_spec},
            },
        },
    }


def test_workers_never_see_the_api_key() -> None:
    spec = {"resources": {"gpus": 1}, "parallelism": {"nodes": 3}}
    service = isvc(**spec, apiKeySecretRef={"name": "keys", "key": "api-key"})
    template = build_leader_worker_set(service, CONFIG)["spec"]["leaderWorkerTemplate"]
    assert "env" in template["leaderTemplate"]["spec"]["containers"][0]
    assert "env" not in template["workerTemplate"]["spec"]["containers"][0]
    assert template["size"] == 3


def test_only_leaders_serve_and_whole_groups_scale() -> None:
    service = isvc(parallelism={"nodes": 2}, autoscaling=AUTOSCALING)
    target = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "tiny",
    }
    assert "replicas" not in build_leader_worker_set(service, CONFIG)["spec"]  # the HPA's
    assert build_service(service)["spec"]["selector"] == LEADERS
    hpa = build_hpa(service)
    assert hpa is not None and hpa["spec"]["scaleTargetRef"] == target
    keda = {**AUTOSCALING, "backend": "keda"}
    scaled = build_scaled_object(isvc(parallelism={"nodes": 2}, autoscaling=keda), CONFIG)
    assert scaled is not None and scaled["spec"]["scaleTargetRef"] == target
    # Leaders are <name>-<group>; workers (<name>-<group>-<index>) export no metrics.
    assert pod_matchers(service) == 'namespace="ml",pod=~"tiny-[0-9]+"'
    routed = isvc(parallelism={"nodes": 2}, routing={"mode": "InferencePool"})
    pool = build_inference_pool(routed)
    assert pool is not None and pool["spec"]["selector"] == {"matchLabels": LEADERS}
