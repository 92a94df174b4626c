"""LeaderWorkerSet groups of real engines on the test cluster: the LWS controller (built from its
module, with its webhooks) makes the leader and worker pods, its pod webhook writes the ``LWS_*``
variables, the kubelet stand-in runs the pods' processes, and the two ranks of one
tensor-parallel group rendezvous on loopback across the two pods.

First a LeaderWorkerSet written by hand (the test cluster's own proof), then one the operator
makes from an InferenceService with ``spec.parallelism.nodes: 2``. Each serves token-exact output
(against one rank in this process), and a killed worker makes the whole group restart
(``RecreateGroupOnPodRestart``) and serve again.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from quire_engine import LLM, SamplingParams
from quire_operator import meta
from tests.cluster.client import ClusterHandle
from tests.cluster.lws import LwsStack
from tests.cluster.pod_launch import Workload
from tests.cluster.pod_runner import ApiServer, PodProcess, PodRunner
from tests.e2e.inference_service import tiny_inference_service
from tests.operator_tests.api import create_isvc
from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators
from tests.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "tp"
LABELS = {"app.kubernetes.io/name": "quire-lws-test"}
PORT = 29500
SHAPE = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(PORT)]
COMMON = ["--model", "tiny", "--device", "cpu", "--num-blocks", "256", *SHAPE]
LEADER_ARGS = ["serve", "--port", "8000", *COMMON]
WORKER_ARGS = [
    "serve", "--headless", *COMMON,
    "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
]  # fmt: skip
PROMPT, MAX_TOKENS = "Hello", 12


def leader_worker_set(namespace: str) -> dict[str, Any]:
    def template(args: list[str]) -> dict[str, Any]:
        container = {"name": "engine", "image": "quire-engine", "command": ["quire-engine"]}
        container["args"] = args
        return {"metadata": {"labels": LABELS}, "spec": {"containers": [container]}}

    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": 2,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template(LEADER_ARGS),
                "workerTemplate": template(WORKER_ARGS),
            },
        },
    }


@contextlib.contextmanager
def _runner(
    cluster: ClusterHandle, namespace: str, selector: str, log_dir: Path
) -> Iterator[PodRunner]:
    log_dir.mkdir(parents=True, exist_ok=True)
    api_server = ApiServer.from_kubeconfig(cluster.kubeconfig)
    running = PodRunner(cluster.control_plane.request, api_server, namespace, selector, log_dir)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def runner(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[PodRunner]:
    selector = ",".join(f"{k}={v}" for k, v in LABELS.items())
    with _runner(cluster, namespace, selector, tmp_path) as running:
        yield running


def _serving(runner: PodRunner, other_than: str = "") -> PodProcess:
    """The leader's engine once it is ready (a new one when ``other_than`` names a pod uid)."""

    def leader() -> PodProcess | None:
        ready = [p for p in runner.engines() if p.uid != other_than]
        return ready[0] if ready else None

    found: PodProcess = wait_until(
        leader,
        timeout=300,
        interval=0.5,
        message=lambda: f"no ready leader; runner errors {runner.errors}\n{runner.report()}",
    )
    return found


def _complete(engine: PodProcess) -> str:
    client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)
    (model,) = client.models.list().data  # "tiny", or the InferenceService's name
    out = client.completions.create(
        model=model.id,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


@pytest.fixture(scope="module")
def expected() -> str:
    """The greedy completion of one rank, in this process."""
    with LLM("tiny", device="cpu", num_blocks=256) as one:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        text: str = one.generate([PROMPT], params)[0].outputs[0].text
    return text


def test_a_group_serves_token_exact_and_a_killed_worker_recreates_it(
    cluster: ClusterHandle, lws: LwsStack, namespace: str, runner: PodRunner, expected: str
) -> None:
    path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets"
    status, reply = cluster.control_plane.request("POST", path, leader_worker_set(namespace))
    assert status == 201, reply
    _serves_and_recreates(runner, NAME, expected)


def test_an_inference_service_over_two_nodes_serves_and_recovers(
    cluster: ClusterHandle,
    lws: LwsStack,
    crds: GarbageCollectorProbe,
    namespace: str,
    operators: Operators,
    tmp_path: Path,
    expected: str,
) -> None:
    operators.start()
    body = tiny_inference_service(NAME, num_blocks=256, max_num_seqs=8, parallelism={"nodes": 2})
    create_isvc(cluster, namespace, body)
    with _runner(cluster, namespace, meta.selector_string(NAME), tmp_path / "pods") as pods:
        _serves_and_recreates(pods, NAME, expected)
    wait_until(
        lambda: _ready(cluster, namespace),
        timeout=120,
        interval=0.5,
        message="the InferenceService never reported Ready again",
    )
    # Only the leader is behind the Service.
    service = cluster.core.read_namespaced_service(NAME, namespace)
    spec, metadata = service.spec, service.metadata
    assert spec is not None and spec.selector is not None and metadata is not None
    assert spec.selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    # It stays the operator's: LWS names its per-group headless Services after the leaders.
    assert spec.cluster_ip != "None"
    assert [o.kind for o in metadata.owner_references or []] == ["InferenceService"]
    headless = cluster.core.read_namespaced_service(f"{NAME}-0", namespace).spec
    assert headless is not None and headless.cluster_ip == "None"


def _ready(cluster: ClusterHandle, namespace: str) -> bool:
    body = cluster.custom.get_namespaced_custom_object(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, NAME
    )
    assert isinstance(body, dict)
    conditions = {c["type"]: c["status"] for c in body.get("status", {}).get("conditions", [])}
    return conditions.get("Ready") == "True"


def _serves_and_recreates(runner: PodRunner, name: str, expected: str) -> None:
    leader = _serving(runner)
    assert leader.pod == f"{name}-0"
    assert _complete(leader) == expected

    (worker,) = runner.processes(Workload.ENGINE_NODE)
    assert worker.pod == f"{name}-0-1"
    # The container dies: its process group (the node process and its rank) is killed.
    os.killpg(worker.process.pid, signal.SIGKILL)
    # The LWS controller sees the worker's restart count and recreates the group: the leader
    # stops, by its own exit 1 (it lost rank 1) or by its pod's deletion, whichever comes
    # first, and a new leader pod (same name, new uid) serves the same tokens.
    wait_until(
        lambda: leader.process.exited() is not None,
        timeout=120,
        interval=0.2,
        message="the leader kept running without its worker",
    )
    again = _serving(runner, other_than=leader.uid)
    assert _complete(again) == expected
