"""Pure builder: a multi-node InferenceService (``spec.parallelism.nodes`` > 1) -> its
LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``), which takes the Deployment's place: one group
of ``nodes`` pods per replica.

The leader pod (worker index 0) is the engine's node 0: rank 0 with the scheduler, HTTP, metrics
and probes, exactly the Deployment's pod plus its rendezvous port. Each worker pod runs
``quire-engine serve --headless`` with node rank ``$(LWS_WORKER_INDEX)`` and joins the leader at
``$(LWS_LEADER_ADDRESS)`` (both written into the pod by the LWS pod webhook; the kubelet expands
them in args). Workers serve no HTTP, so they have no probes, port, API key or metrics
annotations; the group lives and dies as one (``RecreateGroupOnPodRestart``: a worker that exits
because its leader died, or a leader that exits because a worker died, restarts the group).

Who selects what: the Service, the InferencePool and the KEDA triggers see leaders only
(``pod_selector``, ``WORKER_INDEX_LABEL`` 0); the HPA and KEDA scale the LeaderWorkerSet through
its scale subresource, i.e. whole groups. Ownership is the Deployment's (see deployment.py):
``spec.replicas`` is left out when autoscaling is on.
"""

from __future__ import annotations

import copy
from typing import Any

from quire_operator import meta
from quire_operator.builders.deployment import (
    PROMETHEUS_ANNOTATIONS,
    RENDEZVOUS_PORT,
    _pod_spec,
    engine_args,
)
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.spec.view import InferenceService

WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_INDEX = "0"
# Written by the LeaderWorkerSet pod webhook into every container of a group's pods.
LEADER_ADDRESS_VAR = "LWS_LEADER_ADDRESS"
WORKER_INDEX_VAR = "LWS_WORKER_INDEX"
RENDEZVOUS_PORT_NAME = "rendezvous"
# Only the leader serves: these belong to its container alone.
_LEADER_ONLY = ("ports", "startupProbe", "readinessProbe", "livenessProbe", "env")


def pod_selector(isvc: InferenceService) -> dict[str, str]:
    """Labels of the pods that serve: every engine pod, or a group's leaders only."""
    labels = meta.selector_labels(isvc.ref.name)
    if isvc.parallelism.multi_node:
        labels[WORKER_INDEX_LABEL] = LEADER_INDEX
    return labels


def scale_target(isvc: InferenceService) -> dict[str, str]:
    """The ``scaleTargetRef`` of the HPA or ScaledObject: the Deployment or the LeaderWorkerSet."""
    if isvc.parallelism.multi_node:
        api_version, kind = Kind.LEADER_WORKER_SET.api_version, Kind.LEADER_WORKER_SET.value
    else:
        api_version, kind = Kind.DEPLOYMENT.api_version, Kind.DEPLOYMENT.value
    return {"apiVersion": api_version, "kind": kind, "name": isvc.ref.name}


def worker_args(isvc: InferenceService) -> list[str]:
    """``engine_args`` plus what makes a pod one of the group's other nodes."""
    return [
        *engine_args(isvc),
        "--headless",
        "--node-rank", f"$({WORKER_INDEX_VAR})",
        "--master-addr", f"$({LEADER_ADDRESS_VAR})",
    ]  # fmt: skip


def _leader_pod(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    pod = _pod_spec(isvc, config)
    (container,) = pod["containers"]
    port = {"name": RENDEZVOUS_PORT_NAME, "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}
    container["ports"] = [*container["ports"], port]
    return pod


def _worker_pod(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    pod = copy.deepcopy(_pod_spec(isvc, config))
    (container,) = pod["containers"]
    for key in _LEADER_ONLY:
        container.pop(key, None)
    container["args"] = worker_args(isvc)
    return pod


def build_leader_worker_set(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The apply configuration of the LeaderWorkerSet (see the module docstring)."""
    name = isvc.ref.name
    leader_labels = {**meta.labels(name), meta.ENGINE_TYPE_LABEL: meta.ENGINE_TYPE}
    spec: dict[str, Any] = {
        # Workers are created once their leader exists (the default, spelled out): a worker
        # connects to the leader's rendezvous, which it retries until the leader listens.
        "startupPolicy": "LeaderCreated",
        # One headless Service per group, named after its leader pod (``<name>-<group>``), for the
        # pods' DNS names. The default (Shared) makes one named ``<name>``: the operator's own
        # Service, which LWS would then either take (a headless Service selecting every pod,
        # workers included) or find taken (and the pods' DNS names would not resolve).
        "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
        "leaderWorkerTemplate": {
            "size": isvc.parallelism.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": {
                "metadata": {"labels": leader_labels, "annotations": dict(PROMETHEUS_ANNOTATIONS)},
                "spec": _leader_pod(isvc, config),
            },
            "workerTemplate": {
                "metadata": {"labels": meta.labels(name)},
                "spec": _worker_pod(isvc, config),
            },
        },
    }
    if not isvc.autoscaling.enabled:
        spec["replicas"] = isvc.replicas
    return {
        "apiVersion": Kind.LEADER_WORKER_SET.api_version,
        "kind": Kind.LEADER_WORKER_SET.value,
        "metadata": meta.object_meta(isvc.ref),
        "spec": spec,
    }
