"""``spec.lora`` end to end on the real control plane: a real ``quire-operator``, the Job and
PersistentVolume controllers, the kubelet stand-in running the download Jobs and the engines as
local processes, and the Hub stand-in serving both the base checkpoint and an adapter repository
(one mirror, ``spec.model.hfEndpoint``).

One InferenceService, two replicas, an API key, three adapters: ``lyon`` (hf://, fetched into
the model cache by its own Job), ``paris`` (file://) and ``wide`` (file://, rank 16 over
``maxLoraRank`` 8: the engine refuses it). The operator loads the first two into both replicas
at runtime and reports ``wide`` as Failed (condition and Event) while the others serve; requests
naming ``lyon`` get peft's merged model's greedy tokens from either replica. Taking ``paris`` and
``wide`` out of the spec unloads ``paris`` from both replicas without restarting them, and a
replica that restarts gets ``lyon`` back.

Without a model cache (the model downloaded by the pod's init container, run by the kubelet
stand-in), an hf:// adapter is downloaded by the replica itself as the operator loads it.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from kubernetes import client

from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.pod_runner import PodRunner
from tests.engine_tests import models
from tests.engine_tests.model.test_lora import (
    PROMPTS,
    make_adapter,
    reference,
    tie_free_prefix,
)
from tests.hub_server import HubServer
from tests.operator_tests.api import MERGE, condition, get_isvc
from tests.operator_tests.operator_process import Operators
from tests.operator_tests.test_model_cache_cluster import (
    NAME,
    REPO,
    cached_service,
    runner,  # noqa: F401 (a fixture)
    volume,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.cluster

ADAPTER_REPO = "quire-test/tiny-llama-lora-lyon"
KEY = "lora-e2e-key"
START_S = 240


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """The base checkpoint, three peft adapters of it, and the merged reference of ``lyon``."""
    root = tmp_path / "lora"
    base = models.build("llama", root / "base")
    _, lyon_ref = make_adapter(base, root, "lyon", 1, 8, ["q_proj", "v_proj", "down_proj"])
    make_adapter(base, root, "paris", 2, 4, ["o_proj", "up_proj"])
    make_adapter(base, root, "wide", 3, 16, ["q_proj"])
    return {"base": base, "root": root, "lyon_ref": lyon_ref}


@pytest.fixture
def hub(files: dict[str, Path]) -> Iterator[HubServer]:
    """The base checkpoint's mirror; a test puts the adapter's repository behind it."""
    server = HubServer(REPO, files["base"]).start()
    yield server
    server.stop()


def _service(hub: HubServer, storage_class: str, root: Path) -> dict[str, Any]:
    body = cached_service(hub, storage_class)
    body["spec"]["replicas"] = 2
    body["spec"]["apiKeySecretRef"] = {"name": "lora-key", "key": "key"}
    body["spec"]["lora"] = {
        "maxLoras": 2,
        "maxLoraRank": 8,
        "adapters": [
            {"name": "lyon", "uri": f"hf://{ADAPTER_REPO}"},
            {"name": "paris", "uri": f"file://{root / 'paris'}"},
            {"name": "wide", "uri": f"file://{root / 'wide'}"},
        ],
    }
    return body


def _adapters(cluster: ClusterHandle, namespace: str) -> dict[str, dict[str, Any]]:
    status = get_isvc(cluster, namespace, NAME).get("status") or {}
    return {a["name"]: a for a in status.get("adapters") or []}


def _served(url: str) -> dict[str, str]:
    listed = httpx2.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    return {card["id"]: card["root"] for card in listed["data"] if card.get("parent")}


def _greedy(url: str, model: str, prompt: list[int]) -> list[int]:
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    out = oai.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_adapters_are_loaded_unloaded_and_restored_on_every_replica(
    cluster: ClusterHandle,
    namespace: str,
    operators: Operators,
    hub: HubServer,
    volume: tuple[str, Path],  # noqa: F811 (the fixture imported above)
    runner: PodRunner,  # noqa: F811
    files: dict[str, Path],
) -> None:
    storage_class, directory = volume
    hub.also_serve(HubServer(ADAPTER_REPO, files["root"] / "lyon"))
    encoded = base64.b64encode(KEY.encode()).decode()
    secret = {"metadata": {"name": "lora-key"}, "data": {"key": encoded}}
    cluster.core.create_namespaced_secret(namespace, secret)  # type: ignore[arg-type]  # dict body
    operators.start()
    custom = ("quire.dev", "v1alpha1", namespace, "inferenceservices")
    cluster.custom.create_namespaced_custom_object(
        *custom, _service(hub, storage_class, files["root"])
    )

    def settled(found: dict[str, dict[str, Any]]) -> bool:
        states = {name: a["state"] for name, a in found.items()}
        return states == {"lyon": "Loaded", "paris": "Loaded", "wide": "Failed"} and all(
            len(found[name]["loadedOn"]) == 2 for name in ("lyon", "paris")
        )

    found = wait_for(
        "lyon and paris Loaded on 2 replicas, wide Failed",
        lambda: _adapters(cluster, namespace),
        settled,
        timeout_s=START_S,
    )
    assert found["lyon"]["job"].startswith(f"{NAME}-adapter-"), found["lyon"]
    assert (directory / ADAPTER_REPO / "@main" / ".quire-complete.json").is_file()
    assert "rank 16; max_lora_rank is 8" in found["wide"]["message"], found["wide"]
    isvc = get_isvc(cluster, namespace, NAME)
    adapters_ready = condition(isvc, "AdaptersReady")
    assert adapters_ready["status"] == "False" and adapters_ready["reason"] == "AdapterFailed"
    assert adapters_ready["message"].startswith("wide: pod "), adapters_ready
    assert condition(isvc, "Ready")["status"] == "True"  # the others keep serving
    events = cluster.core.list_namespaced_event(namespace).items
    failed = [e for e in events if e.reason == "AdapterFailed"]
    assert failed and (failed[0].message or "").startswith("adapter wide: pod "), failed

    engines = {proc.pod: proc for proc in runner.engines()}
    assert set(engines) == set(found["lyon"]["loadedOn"]), (engines, found)
    expected = reference(str(files["lyon_ref"]))
    for proc in engines.values():
        assert _served(proc.url) == {"lyon": "hf/quire-test/tiny-llama-lora-lyon/@main",
                                     "paris": str(files["root"] / "paris")}  # fmt: skip
        for i in (0, 2):
            tokens, margins = expected[i]
            n = tie_free_prefix(margins)
            assert n >= 4, f"prompt {i}: the reference has a near-tie at token {n}"
            assert _greedy(proc.url, "lyon", PROMPTS[i])[:n] == tokens[:n], (proc.pod, i)

    # Out of the spec: paris is unloaded from both replicas, which keep running.
    pids = {pod: proc.process.pid for pod, proc in engines.items()}
    spec = _service(hub, storage_class, files["root"])["spec"]
    spec["lora"]["adapters"] = spec["lora"]["adapters"][:1]
    cluster.custom.patch_namespaced_custom_object(
        *custom, NAME, {"spec": {"lora": spec["lora"]}}, _content_type=MERGE
    )
    wait_for(
        "paris unloaded everywhere",
        lambda: [_served(proc.url) for proc in engines.values()],
        lambda served: all(set(s) == {"lyon"} for s in served),
        timeout_s=60,
    )
    isvc = wait_for(
        "AdaptersReady",
        lambda: get_isvc(cluster, namespace, NAME),
        lambda obj: condition(obj, "AdaptersReady").get("status") == "True",
        timeout_s=60,
    )
    assert [a["name"] for a in isvc["status"]["adapters"]] == ["lyon"]
    assert {proc.pod: proc.process.pid for proc in runner.engines()} == pids

    # A replica that restarts gets lyon back.
    gone = sorted(engines)[0]
    cluster.core.delete_namespaced_pod(gone, namespace, body=client.V1DeleteOptions())
    deadline = time.monotonic() + START_S

    def fresh() -> dict[str, Any]:
        assert time.monotonic() < deadline, runner.report()
        return _adapters(cluster, namespace)["lyon"]

    lyon = wait_for(
        "lyon loaded on the new replica",
        fresh,
        lambda a: a["state"] == "Loaded" and len(a["loadedOn"]) == 2 and gone not in a["loadedOn"],
        timeout_s=START_S,
    )
    (new,) = [proc for proc in runner.engines() if proc.pod not in engines]
    assert new.pod in lyon["loadedOn"]
    tokens, margins = expected[0]
    n = tie_free_prefix(margins)
    assert _greedy(new.url, "lyon", PROMPTS[0])[:n] == tokens[:n]


def test_without_a_cache_each_replica_downloads_its_hf_adapters(
    cluster: ClusterHandle,
    namespace: str,
    operators: Operators,
    hub: HubServer,
    runner: PodRunner,  # noqa: F811
    files: dict[str, Path],
) -> None:
    """An hf:// model without spec.model.cache (its init container downloads it into the pod)
    and an hf:// adapter pinned to a commit: the replica downloads the adapter itself as the
    operator loads it (``hf://org/name@commit``), from the model's mirror, and serves it."""
    adapter_hub = hub.also_serve(HubServer(ADAPTER_REPO, files["root"] / "lyon"))
    operators.start()
    body = cached_service(hub, "unused")
    del body["spec"]["model"]["cache"]
    adapter = {"name": "lyon", "uri": f"hf://{ADAPTER_REPO}", "revision": adapter_hub.commit}
    body["spec"]["lora"] = {"maxLoraRank": 8, "adapters": [adapter]}
    cluster.custom.create_namespaced_custom_object(
        "quire.dev", "v1alpha1", namespace, "inferenceservices", body
    )
    found = wait_for(
        "lyon Loaded",
        lambda: _adapters(cluster, namespace),
        lambda a: a.get("lyon", {}).get("state") == "Loaded",
        timeout_s=START_S,
    )
    assert "job" not in found["lyon"], found  # no Job: the replica fetched it
    (engine,) = runner.engines()
    uri = f"hf://{ADAPTER_REPO}@{adapter_hub.commit}"
    listed = httpx2.get(f"{engine.url}/v1/models").json()["data"]
    assert {c["id"]: c["root"] for c in listed if c.get("parent")} == {"lyon": uri}
    assert dict(adapter_hub.body_bytes) == {p: len(f.data) for p, f in adapter_hub.files.items()}
    tokens, margins = reference(str(files["lyon_ref"]))[0]
    n = tie_free_prefix(margins)
    oai = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)
    out = oai.completions.create(
        model="lyon", prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert [int(t.removeprefix("token_id:")) for t in logprobs.tokens][:n] == tokens[:n]
