"""The custom object -> the typed view of spec/view.py: the one reader of an InferenceService.

Input is the object as the API server stores it: the CRD (crds/inferenceservices.quire.dev.yaml)
has already validated it and filled in every default, so defaulted keys are read directly and only
optional ones with ``.get``.

``read`` is what the reconcile calls, once per reconcile: the parsed ``InferenceService``, or, for
a spec that does not parse, an ``InvalidSpec`` holding the reason and the ``Identity`` (read with
the same leniency as before the spec existed: absent sections mean "not asked for").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from quire_operator.meta import ObjectRef
from quire_operator.spec.lora import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    Adapter,
    AdapterKind,
    LoRASpec,
)
from quire_operator.spec.view import (
    Autoscaling,
    AutoscalingBackend,
    CacheAccessMode,
    EngineSpec,
    FailureMode,
    Identity,
    InferenceService,
    InvalidSpec,
    KedaSettings,
    ModelCache,
    ModelKind,
    ModelSource,
    Parallelism,
    Placement,
    ResourceSpec,
    Routing,
    RoutingMode,
    ScaleToZero,
    ScorerWeights,
    SecretKeyRef,
    ServiceSpec,
)

# Same shapes as the CRD's uri rule; kept as separate patterns so each kind is parsed, not split.
_HF = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
    r"(/(?P<file>[A-Za-z0-9._-]+\.gguf))?$"
)
_PVC = re.compile(
    r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>(/[A-Za-z0-9._-]+)*)/?$"
)
_FILE = re.compile(r"^file://(?P<path>/[A-Za-z0-9._/-]+)$")
# An adapter is a directory: hf:// names a whole repository (no one-file form).
_HF_REPO = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)$")


def parse_parallelism(parallelism: Mapping[str, Any], gpus: int) -> Parallelism:
    """``spec.parallelism``: tensor defaults to the pod's GPU count (1 on CPU); a GPU count the
    parallelism does not use is refused (the CRD's rule says the same)."""
    tensor = parallelism.get("tensor", gpus or 1)
    if gpus and tensor != gpus:
        raise ValueError(
            f"resources.gpus is {gpus} but parallelism.tensor is {tensor}: each tensor-parallel "
            "rank of a pod uses one GPU, so a GPU pod needs exactly parallelism.tensor GPUs"
        )
    return Parallelism(tensor=tensor, nodes=parallelism.get("nodes", 1))


def _secret_key_ref(ref: Mapping[str, Any] | None) -> SecretKeyRef | None:
    return SecretKeyRef(ref["name"], ref["key"]) if ref else None


def _parse_cache(cache: Mapping[str, Any] | None) -> ModelCache | None:
    if cache is None:
        return None
    return ModelCache(
        size=cache["size"],
        storage_class_name=cache.get("storageClassName"),
        access_mode=CacheAccessMode(cache.get("accessMode", CacheAccessMode.READ_WRITE_MANY.value)),
    )


def parse_model(model: Mapping[str, Any], default_served_name: str) -> ModelSource:
    uri: str = model["uri"]
    common: dict[str, Any] = {
        "revision": model.get("revision"),
        "served_name": model.get("servedName") or default_served_name,
        "hf_token": _secret_key_ref(model.get("hfTokenSecretRef")),
        "hf_endpoint": model.get("hfEndpoint"),
        "cache": _parse_cache(model.get("cache")),
    }
    if uri == "tiny":
        return ModelSource(ModelKind.TINY, "tiny", "", **common)
    if match := _HF.match(uri):
        return ModelSource(ModelKind.HF, match["repo"], match["file"] or "", **common)
    if match := _PVC.match(uri):
        return ModelSource(ModelKind.PVC, match["claim"], match["path"].lstrip("/"), **common)
    if match := _FILE.match(uri):
        return ModelSource(ModelKind.FILE, match["path"], "", **common)
    raise ValueError(
        f"model.uri: not hf://org/name[/file.gguf], pvc://claim[/path], file:///path, tiny: {uri}"
    )


def parse_adapter(adapter: Mapping[str, Any]) -> Adapter:
    name, uri = adapter["name"], adapter["uri"]
    revision, rank = adapter.get("revision"), adapter.get("rank")
    if match := _HF_REPO.match(uri):
        return Adapter(name, AdapterKind.HF, match["repo"], "", revision, rank)
    if match := _PVC.match(uri):
        path = match["path"].lstrip("/")
        return Adapter(name, AdapterKind.PVC, match["claim"], path, revision, rank)
    if match := _FILE.match(uri):
        return Adapter(name, AdapterKind.FILE, match["path"].rstrip("/"), "", revision, rank)
    raise ValueError(
        f"lora.adapters[{name}].uri: not hf://org/name, pvc://claim[/path], file:///path: {uri}"
    )


def parse_lora(lora: Mapping[str, Any] | None) -> LoRASpec | None:
    if lora is None:
        return None
    return LoRASpec(
        max_loras=lora.get("maxLoras", DEFAULT_MAX_LORAS),
        max_lora_rank=lora.get("maxLoraRank", DEFAULT_MAX_LORA_RANK),
        max_cpu_loras=lora.get("maxCpuLoras"),
        adapters=tuple(parse_adapter(adapter) for adapter in lora.get("adapters") or ()),
    )


def parse_engine(engine: Mapping[str, Any]) -> EngineSpec:
    return EngineSpec(
        image=engine.get("image"),
        image_pull_policy=engine.get("imagePullPolicy"),
        block_size=engine["blockSize"],
        gpu_memory_utilization=float(engine["gpuMemoryUtilization"]),
        max_num_seqs=engine["maxNumSeqs"],
        max_num_batched_tokens=engine.get("maxNumBatchedTokens"),
        max_model_len=engine.get("maxModelLen"),
        enable_prefix_caching=engine["enablePrefixCaching"],
        preemption_mode=engine["preemptionMode"],
        swap_space_gib=float(engine["swapSpaceGiB"]),
        dtype=engine["dtype"],
        extra_args=tuple(engine.get("extraArgs") or ()),
        kv_cache_dtype=engine["kvCacheDtype"],
        kv_offloading_size_gib=float(engine["kvOffloadingSizeGiB"]),
        shutdown_timeout_s=engine["shutdownTimeoutSeconds"],
        pre_stop_delay_s=engine["preStopDelaySeconds"],
    )


def parse_autoscaling(autoscaling: Mapping[str, Any]) -> Autoscaling:
    def number(key: str) -> float | None:
        value = autoscaling.get(key)
        return None if value is None else float(value)

    # backend and keda arrived with a later CRD: read with defaults for objects stored before.
    keda = autoscaling.get("keda") or {}
    fallback = keda.get("fallback") or {}
    hold = autoscaling.get("scaleToZero") or {}
    return Autoscaling(
        enabled=autoscaling["enabled"],
        min_replicas=autoscaling["minReplicas"],
        max_replicas=autoscaling.get("maxReplicas"),
        target_kv_cache_utilization=number("targetKVCacheUtilization"),
        target_queue_depth=number("targetQueueDepth"),
        target_preemption_rate=number("targetPreemptionRate"),
        behavior=dict(autoscaling.get("behavior") or {}),
        backend=AutoscalingBackend(autoscaling.get("backend", "hpa")),
        target_kv_cache_demand=number("targetKVCacheDemand"),
        keda=KedaSettings(
            server_address=keda.get("serverAddress"),
            polling_interval_s=keda.get("pollingInterval", 15),
            cooldown_period_s=keda.get("cooldownPeriod", 300),
            fallback_failure_threshold=fallback.get("failureThreshold"),
            fallback_replicas=fallback.get("replicas"),
        ),
        scale_to_zero=ScaleToZero(
            queue_size=hold.get("queueSize", 100),
            hold_timeout_s=hold.get("holdTimeoutSeconds", 300),
        ),
    )


# spec.routing.scorerWeights keys -> ScorerWeights fields.
_WEIGHT_FIELDS = {
    "queue": "queue",
    "kvCacheUtilization": "kv_cache_utilization",
    "prefixCache": "prefix_cache",
    "loraAffinity": "lora_affinity",
}


def parse_routing(routing: Mapping[str, Any]) -> Routing:
    # Read with defaults: objects stored before the CRD had spec.routing.
    weights = routing.get("scorerWeights") or {}
    resources = (routing.get("endpointPicker") or {}).get("resources") or {}
    return Routing(
        mode=RoutingMode(routing.get("mode", RoutingMode.SERVICE.value)),
        failure_mode=FailureMode(routing.get("failureMode", FailureMode.FAIL_CLOSE.value)),
        weights=ScorerWeights(
            **{attr: weights[key] for key, attr in _WEIGHT_FIELDS.items() if key in weights}
        ),
        epp_requests=dict(resources.get("requests") or {}),
        epp_limits=dict(resources.get("limits") or {}),
    )


def parse(body: Mapping[str, Any]) -> InferenceService:
    """The custom object (API JSON, defaulted by the API server) -> ``InferenceService``."""
    metadata = body["metadata"]
    spec = body["spec"]
    ref = _ref(metadata)
    resources = spec["resources"]
    return InferenceService(
        ref=ref,
        generation=int(metadata.get("generation", 0)),
        model=parse_model(spec["model"], default_served_name=ref.name),
        engine=parse_engine(spec["engine"]),
        resources=ResourceSpec(
            gpus=resources["gpus"],
            gpu_resource_name=resources["gpuResourceName"],
            shared_memory=resources["sharedMemory"],
            requests=dict(resources.get("requests") or {}),
            limits=dict(resources.get("limits") or {}),
        ),
        placement=Placement(
            node_selector=dict(spec.get("nodeSelector") or {}),
            tolerations=tuple(spec.get("tolerations") or ()),
            affinity=spec.get("affinity"),
            priority_class_name=spec.get("priorityClassName"),
            service_account_name=spec.get("serviceAccountName"),
            image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or ()),
        ),
        replicas=spec["replicas"],
        autoscaling=parse_autoscaling(spec["autoscaling"]),
        service=ServiceSpec(type=spec["service"]["type"], port=spec["service"]["port"]),
        api_key=_secret_key_ref(spec.get("apiKeySecretRef")),
        routing=parse_routing(spec.get("routing") or {}),
        parallelism=parse_parallelism(spec.get("parallelism") or {}, resources["gpus"]),
        lora=parse_lora(spec.get("lora")),
    )


def _ref(metadata: Mapping[str, Any]) -> ObjectRef:
    return ObjectRef(name=metadata["name"], namespace=metadata["namespace"], uid=metadata["uid"])


def parse_identity(body: Mapping[str, Any]) -> Identity:
    """The identity and the reported facts of an InferenceService whose spec may not parse."""
    metadata, spec = body["metadata"], body["spec"]
    autoscaling = spec.get("autoscaling") or {}
    return Identity(
        ref=_ref(metadata),
        generation=int(metadata.get("generation", 0)),
        port=spec["service"]["port"],
        api_key=bool(spec.get("apiKeySecretRef")),
        routed=(spec.get("routing") or {}).get("mode") == RoutingMode.INFERENCE_POOL.value,
        scales_to_zero=bool(autoscaling.get("enabled")) and autoscaling.get("minReplicas") == 0,
        model_cache=bool((spec.get("model") or {}).get("cache")),
    )


def read(body: Mapping[str, Any]) -> InferenceService | InvalidSpec:
    """The custom object -> its typed view, or why it has none (``InvalidSpec``)."""
    try:
        return parse(body)
    except (ValueError, KeyError) as err:
        return InvalidSpec(parse_identity(body), str(err))
