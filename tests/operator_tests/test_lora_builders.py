"""Unit tests of ``spec.lora`` on the operator side: parsing and its refusals, the engine's flags,
the adapter volumes and paths, the download Job of an hf:// adapter, the status and the Events.
Exact values, no cluster; the end-to-end scenario is tests/operator_tests/test_lora_cluster.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quire_operator.builders.deployment import REFUSED_FLAGS, build_deployment
from quire_operator.builders.desired import adapter_jobs, download_job, model_cache_children
from quire_operator.builders.lora import ENGINE_HF_HOME, LORA_FLAGS, adapter_path
from quire_operator.config import OperatorConfig
from quire_operator.observed.views import parse_serving_pod
from quire_operator.spec.lora import AdapterKind
from quire_operator.spec.parsing import read
from quire_operator.spec.view import InvalidSpec
from quire_operator.status.adapters import AdapterObservation, AdapterState, PodFailure
from quire_operator.status.conditions import Observation, build_status
from quire_operator.status.events import NORMAL, WARNING, Transition, transitions
from tests.operator_tests.helpers import conditions, inference_service, load_example
from tests.operator_tests.test_builders import isvc

CONFIG = OperatorConfig()
HF_MODEL = {"uri": "hf://org/base", "cache": {"size": "10Gi"}}
ADAPTERS: list[dict[str, Any]] = [
    {"name": "lyon", "uri": "hf://org/lyon", "revision": "abc123"},
    {"name": "sql", "uri": "pvc://adapters/sql/v2"},
    {"name": "chat", "uri": "pvc://weights/chat"},
    {"name": "img", "uri": "file:///opt/adapters/img/", "rank": 32},
]


def _lora(**lora: Any) -> dict[str, Any]:
    return {"maxLoras": 4, "maxLoraRank": 32, "adapters": ADAPTERS, **lora}


def _pod(isvc_: Any) -> dict[str, Any]:
    pod: dict[str, Any] = build_deployment(isvc_, CONFIG)["spec"]["template"]["spec"]
    return pod


def test_the_spec_is_read_with_every_source_kind() -> None:
    lora = isvc(model=HF_MODEL, lora=_lora(maxCpuLoras=8)).lora
    assert lora is not None
    assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (4, 32, 8)
    found = [(a.name, a.kind, a.location, a.sub_path, a.revision, a.rank) for a in lora.adapters]
    assert found == [
        ("lyon", AdapterKind.HF, "org/lyon", "", "abc123", None),
        ("sql", AdapterKind.PVC, "adapters", "sql/v2", None, None),
        ("chat", AdapterKind.PVC, "weights", "chat", None, None),
        ("img", AdapterKind.FILE, "/opt/adapters/img", "", None, 32),
    ]
    assert [adapter_path(a, cached=True) for a in lora.adapters] == [
        "hf/org/lyon/@abc123",
        "pvc/adapters/sql/v2",
        "pvc/weights/chat",
        "/opt/adapters/img",
    ]
    assert [a.uri for a in lora.adapters] == [
        "hf://org/lyon", "pvc://adapters/sql/v2", "pvc://weights/chat", "file:///opt/adapters/img"
    ]  # fmt: skip
    # Defaults are the engine's.
    bare = isvc(lora={}).lora
    assert bare is not None and (bare.max_loras, bare.max_lora_rank, bare.adapters) == (1, 16, ())


@pytest.mark.parametrize(
    ("model", "lora", "message"),
    [
        ({"uri": "tiny"}, {"adapters": [{"name": "tiny", "uri": "file:///a"}]}, "served name"),
        ({"uri": "tiny"}, {"adapters": [ADAPTERS[1], ADAPTERS[1]]}, "repeated: sql"),
        ({"uri": "tiny"}, {"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras (2) must be >="),
        ({"uri": "tiny"}, {"adapters": [{"name": "x", "uri": "s3://b/x"}]}, "not hf://org/name"),
        ({"uri": "tiny"}, {"adapters": [{"name": "x", "uri": "hf://o/n/f.gguf"}]}, "not hf://"),
        (
            {"uri": "tiny"},
            {"adapters": [{"name": "x", "uri": "file:///a", "revision": "v1"}]},
            "revision applies only to hf://",
        ),
        ({"uri": "tiny"}, {"adapters": [{"name": "-x", "uri": "file:///a"}]}, "must be 1-128"),
        (
            {"uri": "tiny"},
            {"maxLoraRank": 8, "adapters": [{"name": "x", "uri": "file:///a", "rank": 16}]},
            "rank 16 is above lora.maxLoraRank 8",
        ),
    ],
)
def test_a_spec_the_operator_cannot_serve_is_refused_naming_the_field(
    model: dict[str, Any], lora: dict[str, Any], message: str
) -> None:
    spec = {**load_example()["spec"], "model": model, "lora": lora}
    found = read(inference_service(spec, name="tiny"))
    assert isinstance(found, InvalidSpec), found
    assert message in found.error


def test_without_a_cache_replicas_download_hf_adapters_with_the_models_hub_settings() -> None:
    token = {"name": "hf", "key": "token"}
    model = {"uri": "hf://org/base", "hfEndpoint": "http://mirror:8080", "hfTokenSecretRef": token}
    service = isvc(model=model, lora=_lora(adapters=ADAPTERS[:1]))
    assert service.lora is not None
    (lyon,) = service.lora.adapters
    assert adapter_path(lyon, cached=False) == "hf://org/lyon@abc123"
    unpinned = isvc(model=model, lora=_lora(adapters=[{"name": "x", "uri": "hf://org/x"}])).lora
    assert unpinned is not None and adapter_path(unpinned.adapters[0], cached=False) == "hf://org/x"
    env = _pod(service)["containers"][0]["env"]
    assert env == [
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
        {"name": "HF_ENDPOINT", "value": "http://mirror:8080"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": token}},
    ]
    dockerfile = (Path(__file__).parents[2] / "Dockerfile.engine").read_text()
    assert f"HF_HOME={ENGINE_HF_HOME}" in dockerfile  # the image's own, said again
    # The same env with no adapter yet: the first hf:// adapter changes no pod.
    assert _pod(isvc(model=model, lora=_lora(adapters=[]))) == _pod(service)
    assert adapter_jobs(service, CONFIG) == {}
    # Every node's ranks read the adapter's files: several nodes need the cache.
    spec = {**load_example()["spec"], "model": model, "lora": _lora(adapters=ADAPTERS[:1])}
    spec["parallelism"] = {"nodes": 2}
    found = read(inference_service(spec, name="tiny"))
    assert isinstance(found, InvalidSpec) and "set spec.model.cache" in found.error


def test_engine_flags_turn_lora_on_without_naming_an_adapter() -> None:
    args = _pod(isvc(model=HF_MODEL, lora=_lora()))["containers"][0]["args"]
    tail = args[args.index("--enable-lora") :]
    assert tail == [
        "--enable-lora",
        "--allow-runtime-lora-updating",
        "--lora-dir", "/adapters",
        "--max-loras", "4",
        "--max-lora-rank", "32",
    ]  # fmt: skip
    # Adding or removing an adapter does not change the pod template (no rollout).
    fewer = isvc(model=HF_MODEL, lora=_lora(adapters=ADAPTERS[:2]))
    assert _pod(fewer)["containers"] != _pod(isvc(model=HF_MODEL, lora=_lora()))["containers"]
    same_claims = isvc(model=HF_MODEL, lora=_lora(adapters=[*ADAPTERS[:3]]))
    assert _pod(same_claims) == _pod(isvc(model=HF_MODEL, lora=_lora()))
    assert "--enable-lora" not in _pod(isvc())["containers"][0]["args"]
    assert set(LORA_FLAGS) <= set(REFUSED_FLAGS)


def test_adapter_volumes_mount_the_cache_and_each_claim_once_read_only() -> None:
    pod = _pod(isvc(model=HF_MODEL, lora=_lora()))
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"].startswith("/a")]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "lora" in v["name"]}
    by_path = {m["mountPath"]: m for m in mounts}
    assert set(by_path) == {"/adapters/hf", "/adapters/pvc/adapters", "/adapters/pvc/weights"}
    assert all(m["readOnly"] for m in mounts)
    assert by_path["/adapters/hf"]["name"] == "model"  # the cache's claim, a second mount
    assert sorted(c["claimName"] for c in claims.values()) == ["adapters", "weights"]
    assert all(c["readOnly"] for c in claims.values())
    # An adapter on the model's own claim reuses its volume.
    on_model = isvc(model={"uri": "pvc://weights/base"}, lora=_lora(adapters=[ADAPTERS[2]]))
    pod = _pod(on_model)
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if "adapters" in m["mountPath"]]
    assert mount == {"name": "model", "mountPath": "/adapters/pvc/weights", "readOnly": True}
    assert [v for v in pod["volumes"] if "lora" in v["name"]] == []


def test_each_hf_adapter_gets_its_own_download_job() -> None:
    service = isvc(model=HF_MODEL, lora=_lora())
    jobs = adapter_jobs(service, CONFIG)
    assert list(jobs) == ["lyon"]
    job = jobs["lyon"]
    assert job["metadata"]["name"].startswith("tiny-adapter-")
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "adapter-cache"
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--repo") + 1] == "org/lyon"
    assert command[command.index("--dir") + 1] == "/models/org/lyon/@abc123"
    assert command[command.index("--revision") + 1] == "abc123"
    assert "--file" not in command
    cache = model_cache_children(service, CONFIG)
    assert job["metadata"]["name"] in {key.name for key in cache}
    model_job = download_job(cache)
    assert model_job is not None and model_job.startswith("tiny-model-")
    # A new revision is a new Job (the finished one stays as a record).
    moved = isvc(model=HF_MODEL, lora=_lora(adapters=[{**ADAPTERS[0], "revision": "def456"}]))
    assert adapter_jobs(moved, CONFIG)["lyon"]["metadata"]["name"] != job["metadata"]["name"]


def test_only_ready_serving_pods_are_called() -> None:
    def pod(ready: str, ip: str | None = "10.0.0.7", **labels: str) -> dict[str, Any]:
        status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": {"name": "p", "labels": labels}, "status": status}

    serving = parse_serving_pod(pod("True"))
    assert serving is not None and (serving.name, serving.ip) == ("p", "10.0.0.7")
    assert parse_serving_pod(pod("False")) is None
    assert parse_serving_pod(pod("True", ip=None)) is None
    worker = {"leaderworkerset.sigs.k8s.io/worker-index": "1"}
    assert parse_serving_pod(pod("True", **worker)) is None
    leader = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert parse_serving_pod(pod("True", **leader)) is not None


def _observation(adapters: list[AdapterObservation]) -> Observation:
    return Observation(1, "u", "s", False, None, None, [], adapters=adapters)


LOADED = AdapterObservation("a", "hf://o/a", 2, ("p1", "p2"), job="j")
PARTIAL = AdapterObservation("b", "file:///b", 2, ("p1",))
REFUSED = AdapterObservation("c", "file:///c", 2, ("p2",), (PodFailure("p1", "rank 64"),))
DOWNLOADING = AdapterObservation("d", "hf://o/d", 2, job="j2", waiting_for="downloading (Job j2)")


def test_adapter_states_and_the_status_rows() -> None:
    assert [o.state for o in (LOADED, PARTIAL, REFUSED, DOWNLOADING)] == [
        AdapterState.LOADED, AdapterState.PARTIAL, AdapterState.FAILED, AdapterState.PENDING,
    ]  # fmt: skip
    assert AdapterObservation("e", "file:///e", 0).message == "no replica is ready to load it"
    failed_download = AdapterObservation("f", "hf://o/f", 2, waiting_for="x", download_failed=True)
    assert failed_download.state is AdapterState.FAILED
    status = build_status(_observation([LOADED, REFUSED]), {}, "T")
    assert status["adapters"] == [
        {"name": "a", "uri": "hf://o/a", "state": "Loaded", "loadedOn": ["p1", "p2"], "job": "j",
         "message": "loaded on 2/2 ready replicas"},
        {"name": "c", "uri": "file:///c", "state": "Failed", "loadedOn": ["p2"],
         "message": "pod p1: rank 64"},
    ]  # fmt: skip


def test_adapters_ready_condition() -> None:
    def ready(adapters: list[AdapterObservation]) -> tuple[str, str, str]:
        return conditions(build_status(_observation(adapters), {}, "T"))["AdaptersReady"]

    assert ready([LOADED]) == ("True", "AdaptersLoaded", "1 adapters loaded on every ready replica")
    assert ready([LOADED, PARTIAL, DOWNLOADING]) == (
        "False", "AdaptersPending", "not loaded everywhere yet: b (partial), d (pending)"
    )  # fmt: skip
    assert ready([LOADED, REFUSED, DOWNLOADING]) == ("False", "AdapterFailed", "c: pod p1: rank 64")
    # No condition and no status.adapters without spec.lora.
    status = build_status(Observation(1, "u", "s", False, None, None, []), {}, "T")
    assert "adapters" not in status and "AdaptersReady" not in conditions(status)


def test_an_adapter_that_fails_or_loads_is_an_event_once() -> None:
    def status(*adapters: AdapterObservation) -> dict[str, Any]:
        return build_status(_observation(list(adapters)), {}, "T")

    first = status(PARTIAL, DOWNLOADING)
    then = status(LOADED, REFUSED)
    found = [t for t in transitions(first, then) if t.reason.startswith("Adapter")]
    assert found == [
        Transition(NORMAL, "AdapterLoaded", "adapter a: loaded on 2/2 ready replicas"),
        Transition(WARNING, "AdapterFailed", "adapter c: pod p1: rank 64"),
    ]
    assert [t for t in transitions(then, then) if t.reason.startswith("Adapter")] == []
    other = AdapterObservation("c", "file:///c", 2, (), (PodFailure("p2", "bad files"),))
    again = [t for t in transitions(then, status(LOADED, other)) if t.reason.startswith("Adapter")]
    assert again == [Transition(WARNING, "AdapterFailed", "adapter c: pod p2: bad files")]
