"""The fake nodes kwok manages in the test cluster, shaped like a small real GPU cluster.

Tests import the names and constants from here instead of repeating label or taint strings.
Owner: the launcher creates these Node objects once the API server is ready; kwok (selected by
the ``kwok.x-k8s.io/node: fake`` annotation) then reports them Ready and runs their pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE = "kwok-gpu-0"
CPU_NODE = "kwok-cpu-0"
GPUS_PER_NODE = 8

# Cloud GPU node pools taint GPU nodes so only pods that tolerate it (GPU workloads) land there;
# the key is the resource name, as GKE and AKS do.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
# The labels NVIDIA's GPU feature discovery puts on a node; operators select on them.
GPU_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": str(GPUS_PER_NODE),
}

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_SELECTOR = f"{KWOK_ANNOTATION}=fake"


def _node(
    name: str,
    capacity: dict[str, str],
    labels: dict[str, str],
    taints: list[dict[str, str]],
    pod_cidr: str | None,
) -> dict[str, Any]:
    # kwok takes each pod's IP from its node's podCIDR (see podnet.py); a kubelet would be given
    # one by the node IPAM controller, which this cluster does not run.
    spec: dict[str, Any] = {"taints": taints}
    if pod_cidr is not None:
        spec |= {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **labels,
            },
        },
        "spec": spec,
        # The API server keeps the status given at creation (a kubelet registers this way too);
        # kwok's node-initialize stage then adds conditions and keeps these quantities.
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def fake_nodes(pod_cidrs: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One 8-GPU node (labelled and tainted like a real one) and one plain CPU node; the n-th
    gets ``pod_cidrs[n]`` as its podCIDR when given (else kwok's ``--cidr`` applies)."""
    cidrs = [*pod_cidrs, None, None]
    gpu = _node(
        GPU_NODE,
        {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "110",
            "ephemeral-storage": "1Ti",
            GPU_RESOURCE: str(GPUS_PER_NODE),
        },
        {**GPU_LABELS, "node.kubernetes.io/instance-type": "kwok-gpu-8x"},
        [GPU_TAINT],
        cidrs[0],
    )
    cpu = _node(
        CPU_NODE,
        {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "500Gi"},
        {"node.kubernetes.io/instance-type": "kwok-cpu"},
        [],
        cidrs[1],
    )
    return [gpu, cpu]
