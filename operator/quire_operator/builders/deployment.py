"""Pure builder: InferenceService -> the engine Deployment (a dict, as it is server-side applied).

Ownership (server-side apply, field manager ``quire-operator``): the operator owns exactly the
fields in the dict this module returns. Two consequences are deliberate:

- ``spec.replicas`` is left out when autoscaling is on, so the HPA (which writes it through the
  scale subresource) is its only owner and the operator never reverts a scaling decision. With
  autoscaling off it is in the dict and a forced apply takes it back from anyone who changed it.
- Fields nobody here sets (an annotation from ``kubectl rollout restart``, an env var a person
  added) are not the operator's and survive reconciles; anything the operator sets is restored.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from quire_operator import meta
from quire_operator.builders.host_memory import with_host_tier
from quire_operator.builders.lora import ENGINE_HF_HOME, LORA_FLAGS, adapter_volumes, lora_args
from quire_operator.config import OperatorConfig
from quire_operator.spec.view import InferenceService, ModelKind, ModelSource, SecretKeyRef

ENGINE_PORT = 8000
PORT_NAME = "http"
RENDEZVOUS_PORT = 29500  # a multi-node replica's node 0 (leader) listens here for its workers
MODEL_DIR = "/models"
# The engine image's user and its home (Dockerfile.engine: useradd --uid 10001).
ENGINE_UID = 10001
ENGINE_HOME = "/home/quire"
# The root filesystem is read-only; these emptyDirs are all the engine may write. /tmp holds the
# Triton kernel cache and HF_HOME (Dockerfile.engine), the home dir whatever a library caches
# under ~/.cache. Limits turn a runaway writer into an eviction instead of a full node disk.
SCRATCH_VOLUMES = (("tmp", "/tmp", "4Gi"), ("home", ENGINE_HOME, "1Gi"))
# terminationGracePeriodSeconds = preStop delay + drain timeout + this, so the kubelet's SIGKILL
# never cuts a drain that is within its timeout (process exit and log flush take a moment).
GRACE_MARGIN_S = 5
# Cloud GPU node pools taint GPU nodes with this key (GKE, AKS; MIG nodes too), so GPU pods get a
# toleration for it, as the ExtendedResourceToleration admission plugin would add where enabled.
GPU_TAINT_KEY = "nvidia.com/gpu"
# How long a replica may take to load its model before it counts as failed. The startup probe
# and the Deployment's progress deadline share it: loading 100+ GB of weights from a network
# volume takes many minutes, and a replica still loading must not be killed or reported stuck.
MODEL_LOAD_BUDGET_S = 3600
STARTUP_PROBE_PERIOD_S = 10

# Flags set from spec fields; spec.engine.extraArgs may not repeat them (the CRD's CEL rule on
# extraArgs lists the same flags, and a test checks the two lists agree).
MANAGED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--device",
    "--dtype",
    "--kv-cache-dtype",
    "--block-size",
    "--gpu-memory-utilization",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--preemption-mode",
    "--swap-space",
    "--kv-offloading-size",
    "--log-format",
    "--shutdown-timeout",
    # spec.parallelism (and, for a LeaderWorkerSet's workers, the group's own variables)
    "--tensor-parallel-size",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
    "--no-headless",
    "--wait-for-model-cache",  # spec.model.cache: the engine loads only a complete cache
    "--no-wait-for-model-cache",
    *LORA_FLAGS,  # spec.lora
)
# Refused in extraArgs as well: an API key in args would be readable by anyone who can read the
# InferenceService or its pods (spec.apiKeySecretRef passes it through a Secret instead).
REFUSED_FLAGS = (*MANAGED_FLAGS, "--api-key")
API_KEY_ENV = "QUIRE_API_KEY"  # read by quire-engine serve as --api-key

PROMETHEUS_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(ENGINE_PORT),
    "prometheus.io/path": "/metrics",
}


def termination_grace_period_s(isvc: InferenceService) -> int:
    """preStop sleep + the engine's drain timeout + a margin (see GRACE_MARGIN_S)."""
    return isvc.engine.pre_stop_delay_s + isvc.engine.shutdown_timeout_s + GRACE_MARGIN_S


def _number(value: float) -> str:
    """0.9 -> "0.9", 4.0 -> "4": the shortest text argparse reads back to the same float."""
    return f"{value:g}"


def cache_claim_name(name: str) -> str:
    """The model cache's PersistentVolumeClaim of the InferenceService ``name``."""
    return f"{name}-model-cache"


def model_dir(model: ModelSource) -> str:
    """Where an hf:// repository is downloaded (the init container's ``--local-dir``, the
    model cache's download directory in the volume mounted at MODEL_DIR)."""
    assert model.kind is ModelKind.HF, model.kind
    if model.cache is not None:
        # One directory per repository and revision: a new revision is downloaded next to the
        # one replicas are reading, never over it. Quoting keeps a revision such as refs/pr/1
        # one path component.
        return f"{MODEL_DIR}/{model.location}/@{quote(model.revision or 'main', safe='')}"
    return f"{MODEL_DIR}/{model.location}"


def model_path(model: ModelSource) -> str:
    """What ``--model`` points at inside the container: the downloaded directory of an hf://
    model, or its one GGUF file (``hf://org/name/file.gguf``) in it."""
    if model.kind is ModelKind.HF:
        directory = model_dir(model)
        return f"{directory}/{model.sub_path}" if model.sub_path else directory
    if model.kind is ModelKind.PVC:
        return f"{MODEL_DIR}/{model.sub_path}" if model.sub_path else MODEL_DIR
    return model.location  # file: the path in the image; tiny: the engine's own name


def engine_args(isvc: InferenceService) -> list[str]:
    """``quire-engine`` argv after the command: every setting explicit, extraArgs last."""
    engine = isvc.engine
    args = [
        "serve",
        "--model", model_path(isvc.model),
        "--served-model-name", isvc.model.served_name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--device", "cuda" if isvc.resources.gpus else "cpu",
        "--dtype", engine.dtype,
        "--kv-cache-dtype", engine.kv_cache_dtype,
        "--block-size", str(engine.block_size),
        "--gpu-memory-utilization", _number(engine.gpu_memory_utilization),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching",
        "--preemption-mode", engine.preemption_mode,
        "--kv-offloading-size", _number(engine.kv_offloading_size_gib),
        "--log-format", "json",
        "--shutdown-timeout", str(engine.shutdown_timeout_s),
    ]  # fmt: skip
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.preemption_mode == "swap":
        args += ["--swap-space", _number(engine.swap_space_gib)]
    if isvc.model.cache is not None:
        args.append("--wait-for-model-cache")
    if isvc.lora is not None:
        args += lora_args(isvc.lora)
    return args + parallel_args(isvc) + list(engine.extra_args)


def parallel_args(isvc: InferenceService) -> list[str]:
    """The group's shape, the same on every pod of a replica (node 0's rendezvous port too)."""
    parallelism = isvc.parallelism
    args = []
    if parallelism.ranks > 1:
        args += ["--tensor-parallel-size", str(parallelism.ranks)]
    if parallelism.multi_node:
        args += ["--nnodes", str(parallelism.nodes), "--master-port", str(RENDEZVOUS_PORT)]
    return args


def container_security() -> dict[str, Any]:
    """Pod Security Standards "restricted", plus a read-only root, for every container the
    operator runs: the engine writes only to the SCRATCH_VOLUMES, /dev/shm and the model volume
    (the Endpoint Picker only to its /tmp)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security() -> dict[str, Any]:
    """The pod securityContext of every pod running the engine image (engines, the model
    cache's download Job): its non-root user, and its group owning the model volume."""
    return {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_UID,
        "fsGroup": ENGINE_UID,  # the model emptyDir / PVC must be writable/readable by it
        # Without this the kubelet re-chowns every file of a model volume at each mount.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _scratch_mounts() -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": path} for name, path, _ in SCRATCH_VOLUMES]


def _secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def cpu_memory(isvc: InferenceService) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if isvc.resources.requests:
        resources["requests"] = dict(isvc.resources.requests)
    if isvc.resources.limits:
        resources["limits"] = dict(isvc.resources.limits)
    return resources


def _engine_resources(isvc: InferenceService) -> dict[str, Any]:
    resources = with_host_tier(isvc, cpu_memory(isvc))
    if isvc.resources.gpus:
        # Extended resources go in limits only; the API server copies them to requests.
        limits = {**resources.get("limits", {})}
        limits[isvc.resources.gpu_resource_name] = str(isvc.resources.gpus)
        resources["limits"] = limits
    return resources


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _model_volume(isvc: InferenceService) -> dict[str, Any] | None:
    model = isvc.model
    if model.kind is ModelKind.HF and model.cache is not None:
        claim = {"claimName": cache_claim_name(isvc.ref.name), "readOnly": True}
        return {"name": "model", "persistentVolumeClaim": claim}
    if model.kind is ModelKind.HF:
        return {"name": "model", "emptyDir": {}}
    if model.kind is ModelKind.PVC:
        claim = {"claimName": model.location, "readOnly": True}
        return {"name": "model", "persistentVolumeClaim": claim}
    return None


def _hub(model: ModelSource) -> list[dict[str, Any]]:
    """The model's Hub: its endpoint (a mirror) and token, from the Secret, never the spec."""
    env: list[dict[str, Any]] = []
    if model.hf_endpoint is not None:
        env.append({"name": "HF_ENDPOINT", "value": model.hf_endpoint})
    if model.hf_token is not None:
        env.append(_secret_env("HF_TOKEN", model.hf_token))
    return env


def hf_env(model: ModelSource, hf_home: str) -> list[dict[str, Any]]:
    """huggingface_hub's environment for a download: its home, no telemetry, the model's Hub."""
    home = {"name": "HF_HOME", "value": hf_home}
    return [home, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}, *_hub(model)]


def hub_env(isvc: InferenceService) -> list[dict[str, Any]]:
    """The engine container's Hub settings when its replicas may download hf:// adapters: with
    spec.lora on an hf:// model without a cache (set whatever the adapters, so adding the first
    hf:// adapter changes no pod). HF_HOME is the image's own (Dockerfile.engine), said here
    too: downloads land in the scratch /tmp volume whatever the image's environment."""
    model = isvc.model
    if isvc.lora is None or model.kind is not ModelKind.HF or model.cache is not None:
        return []
    return [{"name": "HF_HOME", "value": ENGINE_HF_HOME}, *_hub(model)]


def _download_container(isvc: InferenceService, image: str) -> dict[str, Any]:
    """Init container that fetches an hf:// model into the shared emptyDir with the engine
    image's ``hf`` CLI. The token reaches this container only, and the engine's only with
    spec.lora (its replicas download hf:// adapters themselves: ``lora.hub_env``)."""
    model = isvc.model
    # A GGUF repository holds one file per quantization: fetch only the one served.
    files = [model.sub_path] if model.sub_path else []
    command = ["hf", "download", model.location, *files, "--local-dir", model_dir(model)]
    if model.revision is not None:
        command += ["--revision", model.revision]
    env = hf_env(model, f"{MODEL_DIR}/.hf-home")
    container: dict[str, Any] = {
        "name": "download-model",
        "image": image,
        "command": command,
        "env": env,
        "volumeMounts": [{"name": "model", "mountPath": MODEL_DIR}, *_scratch_mounts()],
        "securityContext": container_security(),
    }
    if resources := cpu_memory(isvc):
        container["resources"] = resources
    return container


def _tolerations(isvc: InferenceService) -> list[dict[str, Any]]:
    tolerations: list[dict[str, Any]] = []
    if isvc.resources.gpus:
        for key in dict.fromkeys([GPU_TAINT_KEY, isvc.resources.gpu_resource_name]):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoSchedule"})
    tolerations += [dict(t) for t in isvc.placement.tolerations if dict(t) not in tolerations]
    return tolerations


def _pod_spec(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    image = isvc.engine.image or config.engine_image
    model_volume = _model_volume(isvc)
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}, *_scratch_mounts()]
    shm = {"medium": "Memory", "sizeLimit": isvc.resources.shared_memory}
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": shm},
        *({"name": name, "emptyDir": {"sizeLimit": size}} for name, _, size in SCRATCH_VOLUMES),
    ]
    if model_volume is not None:
        volumes.append(model_volume)
        mount = {"name": "model", "mountPath": MODEL_DIR}
        # Only the emptyDir of a per-pod download is written by the pod itself.
        writable = isvc.model.kind is ModelKind.HF and isvc.model.cache is None
        mounts.append(mount if writable else {**mount, "readOnly": True})
    cache_claim = cache_claim_name(isvc.ref.name) if isvc.model.cache is not None else None
    lora_volumes, lora_mounts = adapter_volumes(isvc, cache_claim)
    volumes += lora_volumes
    mounts += lora_mounts
    failures = MODEL_LOAD_BUDGET_S // STARTUP_PROBE_PERIOD_S
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "command": ["quire-engine"],
        "args": engine_args(isvc),
        "ports": [{"name": PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        # /ready turns 200 once the model is loaded and warmed; /health only says the process
        # and its engine loop live, so liveness never restarts a replica that is still loading.
        "startupProbe": _probe("/ready", STARTUP_PROBE_PERIOD_S, failures),
        "readinessProbe": _probe("/ready", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        "volumeMounts": mounts,
        "securityContext": container_security(),
    }
    env = hub_env(isvc)
    if isvc.api_key is not None:
        env.append(_secret_env(API_KEY_ENV, isvc.api_key))
    if env:
        container["env"] = env
    if isvc.engine.pre_stop_delay_s:
        # The kubelet's own sleep action (beta and on by default since Kubernetes 1.30, GA in
        # 1.34): the image needs no `sleep` binary, unlike an exec hook.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": isvc.engine.pre_stop_delay_s}}}
    if isvc.engine.image_pull_policy is not None:
        container["imagePullPolicy"] = isvc.engine.image_pull_policy
    if resources := _engine_resources(isvc):
        container["resources"] = resources
    pod: dict[str, Any] = {
        # Service links would inject variables such as QUIRE_PORT=tcp://10.0.0.1:8000 for a
        # Service named "quire", and the engine reads QUIRE_<FLAG> variables as flags.
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API: no token in the pod to steal.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_period_s(isvc),
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": volumes,
    }
    if isvc.model.kind is ModelKind.HF and isvc.model.cache is None:
        pod["initContainers"] = [_download_container(isvc, image)]
    if tolerations := _tolerations(isvc):
        pod["tolerations"] = tolerations
    placement = isvc.placement
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.affinity:
        pod["affinity"] = dict(placement.affinity)
    if placement.priority_class_name:
        pod["priorityClassName"] = placement.priority_class_name
    if placement.service_account_name:
        pod["serviceAccountName"] = placement.service_account_name
    if placement.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in placement.image_pull_secrets]
    return pod


def build_deployment(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The apply configuration of the engine Deployment (see the module docstring for ownership)."""
    name = isvc.ref.name
    spec: dict[str, Any] = {
        "selector": {"matchLabels": meta.selector_labels(name)},
        "progressDeadlineSeconds": MODEL_LOAD_BUDGET_S,
        "template": {
            "metadata": {
                # The engine-type label tells an InferencePool's Endpoint Picker which metric
                # names to read; on every engine pod, so turning routing on restarts no replica.
                "labels": {**meta.labels(name), meta.ENGINE_TYPE_LABEL: meta.ENGINE_TYPE},
                "annotations": dict(PROMETHEUS_ANNOTATIONS),
            },
            "spec": _pod_spec(isvc, config),
        },
    }
    if not isvc.autoscaling.enabled:
        spec["replicas"] = isvc.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta.object_meta(isvc.ref),
        "spec": spec,
    }
