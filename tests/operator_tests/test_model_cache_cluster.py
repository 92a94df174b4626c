"""The model cache end to end on the real control plane: a real ``quire-operator``, the Job and
PersistentVolume controllers, the kubelet stand-in running the download Job's pod and the
engines as local processes (tests/cluster/pod_runner.py), and a Hub stand-in serving a tiny
saved checkpoint (tests/hub_server.py) that the InferenceService names as its mirror
(``spec.model.hfEndpoint``). A GGUF model too: ``hf://org/name/file.gguf`` naming the README
tour's SmolLM2 file in a repository that also holds another quantization; only that file
crosses the wire, and the engine answers from it.

The test cluster has no storage provisioner, so the test makes the PersistentVolume (a hostPath
directory of this machine) that the operator's claim binds to. The Hub's own counters prove
that the model crossed the wire once: a second replica and a restarted one download nothing.
It also prints, for the lead's notes, how long a client asking from the moment a replica is
requested waits for its first token, with the cache empty (miss: download, load) and full
(hit: load only).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from kubernetes import client

from quire_operator.builders.deployment import cache_claim_name
from tests.cluster.client import ClusterHandle, rest_api, wait_for
from tests.cluster.pod_runner import PodProcess, PodRunner
from tests.engine_tests import models
from tests.engine_tests.real_model import require, smollm2_gguf
from tests.hub_server import HubServer
from tests.operator_tests.api import MERGE, condition, get_isvc, ready
from tests.operator_tests.operator_process import Operators

pytestmark = pytest.mark.cluster

NAME = "cached"
REPO = "quire-test/tiny-llama"
INSTANCE = f"app.kubernetes.io/instance={NAME}"
RATE = 25_000.0  # bytes per second
# A replica loads torch, transformers and the model on a shared 2-core machine: generous.
START_S = 240


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    # A slow link (25 kB/s: about 21 s for the tiny checkpoint), so that the download outlasts
    # the engine's own imports and a miss shows what waiting for it costs.
    server = HubServer(REPO, models.build("llama", tmp_path / "checkpoint"), rate=RATE).start()
    yield server
    server.stop()


@pytest.fixture
def volume(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A hostPath PersistentVolume of a StorageClass name only this test uses: (class, dir)."""
    directory = tmp_path / "volume"
    directory.mkdir()
    storage_class = f"cache-{namespace}"
    body = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": storage_class},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": storage_class,
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(directory), "type": "Directory"},
        },
    }
    cluster.core.create_persistent_volume(body)  # type: ignore[arg-type]  # dict body: the client validates it
    yield storage_class, directory
    cluster.core.delete_persistent_volume(storage_class)


@pytest.fixture
def runner(cluster: ClusterHandle, namespace: str, tmp_path: Path) -> Iterator[PodRunner]:
    api, server = rest_api(cluster.core.api_client)
    started = PodRunner(api, server, namespace, INSTANCE, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    started.start()
    yield started
    started.stop()


@dataclass(frozen=True)
class Scene:
    """A running operator, the Hub stand-in, the volume and the kubelet stand-in of one test."""

    cluster: ClusterHandle
    namespace: str
    hub: HubServer
    storage_class: str
    directory: Path  # the PersistentVolume's directory
    runner: PodRunner

    def create(self, **model: Any) -> None:
        body = cached_service(self.hub, self.storage_class, **model)
        self.cluster.custom.create_namespaced_custom_object(
            "quire.dev", "v1alpha1", self.namespace, "inferenceservices", body
        )


@pytest.fixture
def scene(
    cluster: ClusterHandle,
    namespace: str,
    operators: Operators,
    hub: HubServer,
    volume: tuple[str, Path],
    runner: PodRunner,
) -> Scene:
    operators.start()
    return Scene(cluster, namespace, hub, *volume, runner)


def cached_service(hub: HubServer, storage_class: str, **model: Any) -> dict[str, Any]:
    """The InferenceService under test: the Hub stand-in's repository, through the cache."""
    return {
        "apiVersion": "quire.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {
                "uri": f"hf://{REPO}",
                "hfEndpoint": hub.url,
                "cache": {"size": "1Gi", "storageClassName": storage_class},
                **model,
            },
            "engine": {"dtype": "float32", "maxModelLen": 256, "extraArgs": ["--num-blocks", "64"]},
            "resources": {"gpus": 0},
            "replicas": 1,
        },
    }


def first_token_s(since: float, engine: Any, runner: PodRunner) -> str:
    """Seconds from ``since`` until a streamed completion's first token, asked over and over
    from then on (as a client would) of the engine that ``engine()`` names once it exists; with
    the part of its start-up it spent waiting for the cache (its quire_startup_seconds)."""
    served: list[PodProcess] = []

    def token() -> float | None:
        proc: PodProcess | None = engine()
        if proc is None:
            return None
        oai = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        stream = oai.completions.create(model=NAME, prompt="Hello", max_tokens=4, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                served.append(proc)
                return time.monotonic() - since
        return None

    seconds = wait_for_value(token, runner)
    metrics = httpx2.get(f"{served[0].url}/metrics").text
    waited = re.search(r'quire_startup_seconds\{[^}]*phase="model_cache"[^}]*\} (\S+)', metrics)
    assert waited is not None, "the engine timed no model_cache start-up phase"
    return f"{seconds:.1f} s (waiting for the cache {float(waited.group(1)):.1f} s)"


def wait_for_value(fetch: Any, runner: PodRunner) -> float:
    errors = (openai.APIConnectionError, openai.APIStatusError, httpx2.TransportError)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            value = fetch()
        except errors:
            value = None
        if value is not None:
            return float(value)
        time.sleep(0.2)
    raise AssertionError(f"no first token within {START_S} s\n{runner.errors}\n{runner.report()}")


def engine_of(runner: PodRunner, pod: str | None = None, exclude: set[str] | None = None) -> Any:
    def find() -> PodProcess | None:
        for proc in runner.engines(ready_only=False):
            if (pod is None or proc.pod == pod) and proc.pod not in (exclude or set()):
                return proc
        return None

    return find


def test_one_download_serves_every_replica_and_restart(scene: Scene) -> None:
    cluster, namespace, hub, runner = scene.cluster, scene.namespace, scene.hub, scene.runner
    custom = ("quire.dev", "v1alpha1", namespace, "inferenceservices")
    miss_since = time.monotonic()
    scene.create()
    miss = first_token_s(miss_since, engine_of(runner), runner)

    status = ready(cluster, namespace, name=NAME)["status"]
    cache = wait_for(
        "status.modelCache Ready",
        lambda: get_isvc(cluster, namespace, NAME)["status"].get("modelCache", {}),
        lambda found: found.get("state") == "Ready",
        timeout_s=60,
    )
    assert cache["claim"] == cache_claim_name(NAME)
    assert (cache["commit"], cache["bytes"], cache["files"]) == (
        hub.commit, hub.total_bytes, len(hub.files),
    )  # fmt: skip
    assert status["readyReplicas"] == 1
    table = cluster.kubectl("get", "qis", NAME, "-n", namespace, "-o", "wide")
    # Columns are left-aligned under their headers (empty ones too: AUTOSCALER, ZERO here).
    header, row = table.stdout.splitlines()
    assert row[header.index("CACHE") :].split()[0] == "Ready"
    # The checkpoint crossed the wire once, into the volume, marker last.
    assert dict(hub.body_bytes) == {path: len(f.data) for path, f in hub.files.items()}
    model_dir = scene.directory / REPO / "@main"
    assert (model_dir / ".quire-complete.json").is_file()
    asked = sum(hub.requests.values())

    # A second replica: loads from the volume, asks the Hub nothing.
    (first,) = [p.pod for p in runner.engines()]
    hit_since = time.monotonic()
    cluster.custom.patch_namespaced_custom_object(
        *custom, NAME, {"spec": {"replicas": 2}}, _content_type=MERGE
    )
    second = first_token_s(hit_since, engine_of(runner, exclude={first}), runner)
    ready(cluster, namespace, generation=2, name=NAME)

    # A restarted replica (its pod deleted, the ReplicaSet makes another): the same.
    restart_since = time.monotonic()
    cluster.core.delete_namespaced_pod(first, namespace, body=client.V1DeleteOptions())
    remaining = {p.pod for p in runner.engines(ready_only=False)} | {first}
    restarted = first_token_s(restart_since, engine_of(runner, exclude=remaining), runner)
    assert sum(hub.requests.values()) == asked, hub.requests
    jobs = cluster.json(client.BatchV1Api(cluster.api).list_namespaced_job(namespace))["items"]
    assert [job["status"].get("succeeded") for job in jobs] == [1]
    print(
        f"\nmodel cache, first token for a client asking from the moment a replica is "
        f"requested, the Hub stand-in sending {RATE / 1000:g} kB/s: miss (download "
        f"{hub.total_bytes} bytes, load) {miss}; hit (second "
        f"replica) {second}; hit (restarted replica) {restarted}"
    )


def test_a_revision_the_hub_refuses_fails_the_job_at_once_and_degrades(scene: Scene) -> None:
    cluster, namespace, hub = scene.cluster, scene.namespace, scene.hub
    scene.create(revision="v9")
    degraded = wait_for(
        "Degraded=ModelCacheFailed",
        lambda: get_isvc(cluster, namespace, NAME),
        lambda obj: condition(obj, "Degraded").get("reason") == "ModelCacheFailed",
        timeout_s=120,
    )
    cache = degraded["status"]["modelCache"]
    assert cache["state"] == "Failed"
    # The pod failure policy failed the Job on the first attempt's exit code 2, and the status
    # carries the download's own words.
    assert cache["message"].startswith("PodFailurePolicy: ")
    assert "last attempt: RevisionNotFoundError: " in cache["message"]
    assert condition(degraded, "Degraded")["message"] == (
        f"model cache Job {cache['job']}: {cache['message']}"
    )
    assert hub.requests == {f"GET /api/models/{REPO}/revision/v9": 1}
    assert not any(scene.directory.rglob(".quire-complete.json"))


def test_a_gguf_file_is_fetched_alone_and_served(
    cluster: ClusterHandle,
    namespace: str,
    operators: Operators,
    volume: tuple[str, Path],
    runner: PodRunner,
    tmp_path: Path,
) -> None:
    """``hf://quire-test/smollm2-gguf/<file>.gguf``: the Job downloads that file only (not the
    repository's other quantization), the engine gets ``--model`` the file in the volume and
    answers from it (the README tour's question)."""
    gguf_file = require(smollm2_gguf)
    repo_dir = tmp_path / "gguf-repo"
    repo_dir.mkdir()
    (repo_dir / gguf_file.name).symlink_to(gguf_file)
    (repo_dir / "SmolLM2-135M-Instruct.Q8_0.gguf").write_bytes(b"another quantization" * 512)
    repo = "quire-test/smollm2-gguf"
    hub = HubServer(repo, repo_dir).start()
    try:
        operators.start()
        scene = Scene(cluster, namespace, hub, *volume, runner)
        scene.create(uri=f"hf://{repo}/{gguf_file.name}")
        question: Any = [{"role": "user", "content": "What is the capital of France?"}]

        def answer() -> float | None:
            proc = engine_of(runner)()
            if proc is None:
                return None
            oai = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
            out = oai.chat.completions.create(
                model=NAME,
                messages=question,
                temperature=0,
            )
            text = out.choices[0].message.content or ""
            assert "Paris" in text, text
            return 1.0

        wait_for_value(answer, runner)
        (engine,) = runner.engines()
        served = engine.process.argv[engine.process.argv.index("--model") + 1]
        assert served == str(volume[1] / repo / "@main" / gguf_file.name), served
        assert dict(hub.body_bytes) == {gguf_file.name: gguf_file.stat().st_size}
        marker = json.loads((volume[1] / repo / "@main" / ".quire-complete.json").read_text())
        assert marker["only"] == gguf_file.name
        assert [f["path"] for f in marker["files"]] == [gguf_file.name]
    finally:
        hub.stop()
