"""Pure builders of the model cache (``spec.model.cache``): the PersistentVolumeClaim that holds
an hf:// model for every replica, and the Job that fills it once.

Ownership:
- The claim ``<name>-model-cache`` and the Job are the InferenceService's children (controller
  owner reference): the garbage collector deletes them with it, the volume's data with the claim
  (per its StorageClass's reclaim policy).
- The Job is named ``<name>-model-<digest>``, the digest of its whole spec, so any change that
  reaches it (repository, revision, endpoint, token, image) makes a new Job instead of an apply
  to an immutable pod template; the earlier Job stays, finished, as a record. A failed Job is
  retried by deleting it (the next reconcile makes it again).
- Its pod is the only writer of the volume (``python -m quire_engine.hub_cache download``, the
  engine image's own code): one directory per repository and revision (deployment.model_dir;
  for ``hf://org/name/file.gguf`` only that file is fetched into it), a completion marker
  written last. Engines mount the claim read-only and load only once the
  marker is there (``--wait-for-model-cache``).
- Each hf:// adapter of ``spec.lora`` gets a Job of its own, ``<name>-adapter-<digest>``, built
  the same way into ``MODEL_DIR/<org>/<name>/@<revision>`` (labelled ``component:
  adapter-cache``, so the model's Job is told apart); engines see it under ``/adapters/hf``.
- The Job reports the commit, bytes and files it verified in its container's termination
  message (``/dev/termination-log``): Kubernetes' own channel from a finished container to the
  API, which the operator already reads on pods; no extra object or permission is needed.
  ``observed.parse_download`` reads it back.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

from quire_operator import meta
from quire_operator.builders.deployment import (
    MODEL_DIR,
    cache_claim_name,
    container_security,
    cpu_memory,
    hf_env,
    model_dir,
    pod_security,
)
from quire_operator.config import OperatorConfig
from quire_operator.spec.lora import Adapter, AdapterKind
from quire_operator.spec.view import InferenceService, ModelCache

CACHE_APP = "quire-model-cache"
CACHE_COMPONENT = "model-cache"
ADAPTER_COMPONENT = "adapter-cache"
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# Pod retries before the Job fails: each resumes where the last stopped (files already verified
# are kept, a cut transfer continues with an HTTP Range request).
BACKOFF_LIMIT = 4
# quire_engine.hub_cache's exit code when the Hub refuses the repository or revision (not found,
# gated, no access): no retry can help, so the Job fails at once.
EXIT_REFUSED = 2
# huggingface_hub's home (tokens, the xet chunk cache): scratch, never the volume.
SCRATCH = ("tmp", "/tmp", "4Gi")
# Job names are label values (job-name on its pods): at most 63 characters.
_MAX_JOB_NAME = 63
_DIGEST = 10


def labels(name: str, component: str = CACHE_COMPONENT) -> dict[str, str]:
    """The cache's objects and the Jobs' pods: never matched by the engine's selector."""
    return meta.labels(name, app=CACHE_APP, component=component)


class Download(NamedTuple):
    """What one Job fetches: ``repo`` at ``revision`` (None: main) into ``directory`` (a path
    in the volume mounted at MODEL_DIR); ``file``: only that file of it ("" for all)."""

    repo: str
    directory: str
    file: str
    revision: str | None


def build_claim(isvc: InferenceService, cache: ModelCache) -> dict[str, Any]:
    """The cache volume's claim. Only its size may change later (where the StorageClass allows
    expansion); the API server refuses other changes, which the status reports."""
    spec: dict[str, Any] = {
        "accessModes": [cache.access_mode.value],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    name = cache_claim_name(isvc.ref.name)
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta.object_meta(isvc.ref, name, labels(isvc.ref.name)),
        "spec": spec,
    }


def _download_pod(
    isvc: InferenceService, config: OperatorConfig, download: Download
) -> dict[str, Any]:
    model = isvc.model  # its endpoint and token serve its adapters too
    scratch_name, scratch_path, scratch_size = SCRATCH
    command = [
        "python", "-m", "quire_engine.hub_cache", "download",
        "--repo", download.repo,
        "--dir", download.directory,
        "--termination-message-path", TERMINATION_MESSAGE_PATH,
    ]  # fmt: skip
    if download.file:  # one GGUF file of the repository
        command += ["--file", download.file]
    if download.revision is not None:
        command += ["--revision", download.revision]
    container: dict[str, Any] = {
        "name": "download",
        "image": isvc.engine.image or config.engine_image,
        "command": command,
        "env": [
            *hf_env(model, f"{scratch_path}/hf-home"),
            {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
        ],
        "volumeMounts": [
            {"name": "model-cache", "mountPath": MODEL_DIR},
            {"name": scratch_name, "mountPath": scratch_path},
        ],
        "securityContext": container_security(),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        # An error the program could not write (killed for memory) still leaves its last log
        # lines as the message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if isvc.engine.image_pull_policy is not None:
        container["imagePullPolicy"] = isvc.engine.image_pull_policy
    if resources := cpu_memory(isvc):
        container["resources"] = resources
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # a new pod per attempt, each with its own message
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [
            {
                "name": "model-cache",
                "persistentVolumeClaim": {"claimName": cache_claim_name(isvc.ref.name)},
            },
            {"name": scratch_name, "emptyDir": {"sizeLimit": scratch_size}},
        ],
    }
    placement = isvc.placement
    # Where the engines may run, the Job may too (a cluster of GPU nodes only, a ReadWriteOnce
    # volume that must stay on one node).
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [dict(t) for t in placement.tolerations]
    if placement.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in placement.image_pull_secrets]
    return pod


def job_name(isvc: InferenceService, spec: dict[str, Any], what: str = "model") -> str:
    """``<name>-<what>-<digest of spec>``, the name cut so the whole fits 63 characters."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:_DIGEST]
    prefix = isvc.ref.name[: _MAX_JOB_NAME - len(f"-{what}-") - _DIGEST].rstrip("-.")
    return f"{prefix}-{what}-{digest}"


def _job(
    isvc: InferenceService, config: OperatorConfig, download: Download, what: str, component: str
) -> dict[str, Any]:
    name = isvc.ref.name
    refused = {"containerName": "download", "operator": "In", "values": [EXIT_REFUSED]}
    pod = _download_pod(isvc, config, download)
    spec = {
        "backoffLimit": BACKOFF_LIMIT,
        "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": refused}]},
        "template": {"metadata": {"labels": labels(name, component)}, "spec": pod},
    }
    named = job_name(isvc, spec, what)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta.object_meta(isvc.ref, named, labels(name, component)),
        "spec": spec,
    }


def build_job(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The model's download Job (see the module docstring)."""
    model = isvc.model
    download = Download(model.location, model_dir(model), model.sub_path, model.revision)
    return _job(isvc, config, download, "model", CACHE_COMPONENT)


def build_adapter_job(
    isvc: InferenceService, config: OperatorConfig, adapter: Adapter
) -> dict[str, Any]:
    """An hf:// adapter's download Job: the whole repository, into its own directory."""
    assert adapter.kind is AdapterKind.HF, adapter.kind
    directory = f"{MODEL_DIR}/{adapter.cache_subdir}"
    download = Download(adapter.location, directory, "", adapter.revision)
    return _job(isvc, config, download, "adapter", ADAPTER_COMPONENT)
