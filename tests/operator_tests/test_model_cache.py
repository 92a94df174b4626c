"""Unit tests of the model cache (spec.model.cache): spec validation, the exact claim, Job and
engine pod the builders return, and the status the Job's progress gives."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from quire_operator.builders.deployment import build_deployment, container_security, pod_security
from quire_operator.builders.model_cache import build_claim, build_job, job_name
from quire_operator.config import OperatorConfig
from quire_operator.observed.views import parse_deployment, parse_download, parse_job, parse_pod
from quire_operator.spec.parsing import parse
from quire_operator.spec.view import CacheAccessMode, ModelCache
from quire_operator.status.conditions import CacheObservation, Observation, build_status
from tests.operator_tests.helpers import inference_service, load_crd

CONFIG = OperatorConfig()
OWNER = {
    "apiVersion": "quire.dev/v1alpha1",
    "kind": "InferenceService",
    "name": "llm",
    "uid": "0b5c8a5e-1111-4222-8333-944455556666",
    "controller": True,
    "blockOwnerDeletion": True,
}
LABELS = {
    "app.kubernetes.io/name": "quire-model-cache",
    "app.kubernetes.io/instance": "llm",
    "app.kubernetes.io/component": "model-cache",
    "app.kubernetes.io/part-of": "quire",
    "app.kubernetes.io/managed-by": "quire-operator",
}


def cached(**model: Any) -> dict[str, Any]:
    spec = {
        "model": {"uri": "hf://Qwen/Qwen2.5-0.5B", "cache": {"size": "20Gi"}, **model},
        "resources": {"gpus": 0},
    }
    return inference_service(spec)


def test_the_cache_is_parsed_with_its_defaults() -> None:
    model = parse(cached(revision="v1", hfEndpoint="https://mirror.example/hf")).model
    assert model.cache == ModelCache("20Gi", None, CacheAccessMode.READ_WRITE_MANY)
    assert model.hf_endpoint == "https://mirror.example/hf"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"uri": "pvc://weights", "cache": {"size": "1Gi"}}, "model.cache applies only to hf://"),
        ({"uri": "tiny", "hfEndpoint": "http://m"}, "model.hfEndpoint applies only to hf://"),
        ({"uri": "hf://a/b", "cache": {"size": "lots"}}, "model.cache.size must be a quantity"),
        ({"uri": "hf://a/b", "hfEndpoint": "ftp://m"}, "model.hfEndpoint must be an http"),
    ],
)
def test_a_cache_or_endpoint_where_it_cannot_apply_is_refused_by_name(
    model: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse(inference_service({"model": model}))


def test_the_crd_refuses_the_same_specs_with_a_cel_rule() -> None:
    (version,) = load_crd()["spec"]["versions"]
    model = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    rules = {rule["message"]: rule["rule"] for rule in model["x-kubernetes-validations"]}
    refused = "cache applies only to hf:// models (pvc:// and file:// models are already on a "
    assert rules[refused + "volume or in the image)"] == (
        "!has(self.cache) || self.uri.startsWith('hf://')"
    )
    assert rules["hfEndpoint applies only to hf:// models"] == (
        "!has(self.hfEndpoint) || self.uri.startsWith('hf://')"
    )


def test_the_claim() -> None:
    isvc = parse(cached(cache={"size": "20Gi", "storageClassName": "nfs"}))
    assert isvc.model.cache is not None
    assert build_claim(isvc, isvc.model.cache) == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "llm-model-cache",
            "namespace": "ml",
            "labels": LABELS,
            "ownerReferences": [OWNER],
        },
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "20Gi"}},
            "storageClassName": "nfs",
        },
    }


def test_the_download_job() -> None:
    body = cached(revision="refs/pr/1", hfEndpoint="http://mirror:8080",
                  hfTokenSecretRef={"name": "hf"})  # fmt: skip
    isvc = parse(body)
    job = build_job(isvc, CONFIG)
    spec = job["spec"]
    assert job["metadata"] == {
        "name": job_name(isvc, spec),
        "namespace": "ml",
        "labels": LABELS,
        "ownerReferences": [OWNER],
    }
    assert spec == {
        "backoffLimit": 4,
        # quire_engine.hub_cache exits 2 when the Hub refuses: no retry.
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": "download", "operator": "In", "values": [2]},
                }
            ]
        },
        "template": {
            "metadata": {"labels": LABELS},
            "spec": {
                "restartPolicy": "Never",
                "enableServiceLinks": False,
                "automountServiceAccountToken": False,
                # The engine pod's, pinned by test_builders.
                "securityContext": pod_security(),
                "containers": [
                    {
                        "name": "download",
                        "image": CONFIG.engine_image,
                        "command": [
                            "python",
                            "-m",
                            "quire_engine.hub_cache",
                            "download",
                            "--repo",
                            "Qwen/Qwen2.5-0.5B",
                            "--dir",
                            "/models/Qwen/Qwen2.5-0.5B/@refs%2Fpr%2F1",
                            "--termination-message-path",
                            "/dev/termination-log",
                            "--revision",
                            "refs/pr/1",
                        ],
                        "env": [
                            {"name": "HF_HOME", "value": "/tmp/hf-home"},
                            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
                            {"name": "HF_ENDPOINT", "value": "http://mirror:8080"},
                            {
                                "name": "HF_TOKEN",
                                "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
                            },
                            {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
                        ],
                        "volumeMounts": [
                            {"name": "model-cache", "mountPath": "/models"},
                            {"name": "tmp", "mountPath": "/tmp"},
                        ],
                        "securityContext": container_security(),
                        "terminationMessagePath": "/dev/termination-log",
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                    }
                ],
                "volumes": [
                    {
                        "name": "model-cache",
                        "persistentVolumeClaim": {"claimName": "llm-model-cache"},
                    },
                    {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
                ],
            },
        },
    }


def test_the_job_is_renamed_by_any_change_of_what_it_downloads() -> None:
    names = {
        build_job(parse(body), CONFIG)["metadata"]["name"]
        for body in (
            cached(),
            cached(revision="v2"),
            cached(hfEndpoint="http://mirror"),
            cached(uri="hf://Qwen/Qwen3-0.6B"),
        )
    }
    assert len(names) == 4
    assert all(name.startswith("llm-model-") and len(name) == len("llm-model-") + 10
               for name in names)  # fmt: skip
    # A long InferenceService name is cut so the Job's name stays a valid label value.
    long = parse(inference_service(cached()["spec"], name="a" * 63))
    assert len(build_job(long, CONFIG)["metadata"]["name"]) == 63
    # The same spec gives the same name: a reconcile applies to the Job it made.
    assert build_job(parse(cached()), CONFIG) == build_job(parse(cached()), CONFIG)


def test_engines_mount_the_cache_read_only_and_wait_for_it() -> None:
    deployment = build_deployment(parse(cached(revision="v1")), CONFIG)
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert "initContainers" not in pod
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llm-model-cache",
            "readOnly": True}} in pod["volumes"]  # fmt: skip
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    args = engine["args"]
    assert args[args.index("--model") + 1] == "/models/Qwen/Qwen2.5-0.5B/@v1"
    assert args[-1] == "--wait-for-model-cache"


def test_without_the_cache_the_init_container_gets_the_endpoint() -> None:
    body = inference_service({"model": {"uri": "hf://a/b", "hfEndpoint": "http://mirror"}})
    pod = build_deployment(parse(body), CONFIG)["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert {"name": "HF_ENDPOINT", "value": "http://mirror"} in download["env"]
    assert "--wait-for-model-cache" not in pod["containers"][0]["args"]


GGUF_REPO = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
GGUF_FILE = "qwen2.5-0.5b-instruct-q4_k_m.gguf"


def test_a_gguf_uri_downloads_that_file_once_and_serves_it() -> None:
    """``hf://org/name/file.gguf`` with the cache: the Job fetches only that file into the
    repository's directory, engines get ``--model`` the file in it and wait for the directory."""
    isvc = parse(cached(uri=f"hf://{GGUF_REPO}/{GGUF_FILE}", revision="v1"))
    (container,) = build_job(isvc, CONFIG)["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[command.index("--dir") + 1] == f"/models/{GGUF_REPO}/@v1"
    assert command[command.index("--file") + 1] == GGUF_FILE
    assert command[command.index("--repo") + 1] == GGUF_REPO
    (engine,) = build_deployment(isvc, CONFIG)["spec"]["template"]["spec"]["containers"]
    args = engine["args"]
    assert args[args.index("--model") + 1] == f"/models/{GGUF_REPO}/@v1/{GGUF_FILE}"
    assert args[-1] == "--wait-for-model-cache"
    # Another file of the same repository is another Job.
    other = parse(cached(uri=f"hf://{GGUF_REPO}/other.gguf", revision="v1"))
    assert (
        build_job(other, CONFIG)["metadata"]["name"] != build_job(isvc, CONFIG)["metadata"]["name"]
    )
    whole = parse(cached(uri=f"hf://{GGUF_REPO}", revision="v1"))
    (container,) = build_job(whole, CONFIG)["spec"]["template"]["spec"]["containers"]
    assert "--file" not in container["command"]


def test_without_the_cache_a_gguf_uri_is_fetched_alone_by_the_init_container() -> None:
    body = inference_service({"model": {"uri": f"hf://{GGUF_REPO}/{GGUF_FILE}"}})
    pod = build_deployment(parse(body), CONFIG)["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert download["command"] == [
        *("hf", "download", GGUF_REPO, GGUF_FILE),
        *("--local-dir", f"/models/{GGUF_REPO}"),
    ]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == f"/models/{GGUF_REPO}/{GGUF_FILE}"


def test_the_crd_takes_a_gguf_uri_with_the_parsers_shape() -> None:
    """The CRD's uri rule and the parser agree on which hf:// URIs name one file."""
    (version,) = load_crd()["spec"]["versions"]
    model = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    (rule,) = model["properties"]["uri"]["x-kubernetes-validations"]
    pattern = re.compile(rule["rule"].removeprefix("self.matches('").removesuffix("')"))
    for uri in (f"hf://{GGUF_REPO}/{GGUF_FILE}", "hf://a/b", "tiny"):
        assert pattern.match(uri), uri
        parse(cached(uri=uri) if uri != "tiny" else inference_service({"model": {"uri": uri}}))
    for uri in ("hf://a/b/config.json", "hf://a/b/sub/m.gguf", "hf://a/b/"):
        assert not pattern.match(uri), uri
        with pytest.raises(ValueError, match=r"model\.uri"):
            parse(cached(uri=uri))


# -- status ------------------------------------------------------------------------------------


def job(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "llm-model-0123456789"}, "status": status}


def condition(kind: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message}


def pod(exit_code: int | None, message: str = "", finished: str = "2026-01-01T00:00:00Z",
        waiting: str | None = None) -> dict[str, Any]:  # fmt: skip
    state: dict[str, Any] = {}
    if exit_code is not None:
        terminated = {"exitCode": exit_code, "message": message, "finishedAt": finished}
        state = {"terminated": {**terminated, "reason": "Error" if exit_code else "Completed"}}
    if waiting is not None:
        state = {"waiting": {"reason": waiting, "message": f"{waiting}: image x"}}
    return {
        "metadata": {"name": f"dl-{finished[-3:-1]}"},
        "status": {"containerStatuses": [{"name": "download", "state": state}]},
    }


def cache_status(
    phase: str | None, found: dict[str, Any] | None, pods: list[dict[str, Any]] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(status.modelCache, the Degraded condition) for a claim phase, Job and pods."""
    cache = CacheObservation(
        claim="llm-model-cache",
        claim_phase=phase,
        job="llm-model-0123456789",
        download=parse_job(found) if found is not None else None,
        pods=[parse_pod(p) for p in pods or []],
        outcome=parse_download(pods or []),
    )
    loading = parse_deployment({"spec": {"replicas": 1}, "status": {"replicas": 1}})
    status = build_status(
        Observation(1, "u", "s", False, None, loading, [], model_cache=cache), {}, "T"
    )
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    return status["modelCache"], degraded


def test_the_cache_state_follows_the_claim_and_the_job() -> None:
    names = {"claim": "llm-model-cache", "job": "llm-model-0123456789"}
    assert cache_status(None, None)[0] == {
        "state": "Pending", **names,
        "message": "the download Job llm-model-0123456789 does not exist yet",
    }  # fmt: skip
    assert cache_status("Pending", job(active=1))[0] == {
        "state": "Pending", **names, "message": "PersistentVolumeClaim llm-model-cache is Pending",
    }  # fmt: skip
    assert cache_status("Bound", job(active=1, failed=1), [pod(1, "OSError: cut")])[0] == {
        "state": "Downloading", **names,
        "message": "Job llm-model-0123456789 is downloading (after 1 failed attempts)",
    }  # fmt: skip
    summary = json.dumps({"commit": "c0ffee", "bytes": 1234, "files": 6})
    done = job(succeeded=1, conditions=[condition("Complete")])
    ready, degraded = cache_status("Bound", done, [pod(1, "cut", "T1"), pod(0, summary, "T2")])
    assert ready == {
        "state": "Ready", **names, "commit": "c0ffee", "bytes": 1234, "files": 6,
        "message": "downloaded and verified",
    }  # fmt: skip
    assert degraded["status"] == "False"


def test_a_failed_job_degrades_with_its_reason_and_last_message() -> None:
    limit = condition(
        "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    )
    failed = job(failed=5, conditions=[limit])
    error = "CacheError: model.safetensors: sha256 ab expected, got cd"
    status, degraded = cache_status("Bound", failed, [pod(1, error)])
    message = (
        f"BackoffLimitExceeded: Job has reached the specified backoff limit; last attempt: {error}"
    )
    assert status["state"] == "Failed" and status["message"] == message
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelCacheFailed")
    assert degraded["message"] == f"model cache Job llm-model-0123456789: {message}"


def test_a_download_pod_that_cannot_start_degrades() -> None:
    status, degraded = cache_status("Bound", job(active=1), [pod(None, waiting="ImagePullBackOff")])
    assert status["state"] == "Pending"
    assert degraded["reason"] == "ModelCacheFailed"
    assert "ImagePullBackOff: image x" in degraded["message"]
