"""Pure builders: InferenceService -> its Endpoint Picker, the Gateway API Inference Extension's
``epp`` (one Deployment, its Service, ServiceAccount, Role, RoleBinding and the ConfigMap of its
EndpointPickerConfig), plus ``routing_children``: every routing object, or None for each when
routing is off.

The picker watches the InferencePool and its pods, scrapes each engine's ``/metrics`` (the vLLM
metric names, chosen by the pods' ``inference.networking.k8s.io/engine-type: vllm`` label), and
answers the Gateway's ext_proc calls on its gRPC port with the pod to use.

Ownership (server-side apply, field manager ``quire-operator``): the operator owns every field
built here; the objects are named ``<name>-epp`` and labelled as the Endpoint Picker's
(``app.kubernetes.io/name: quire-endpoint-picker``), so its pods never match the engine's
selector, the pool's or the chart's monitors. The Role grants exactly what the picker reads, in
its own namespace; the operator holds the same permissions (RBAC lets it grant no more).
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from quire_operator import meta
from quire_operator.builders.deployment import container_security, termination_grace_period_s
from quire_operator.builders.inference_pool import EPP_GRPC_PORT, build_inference_pool, epp_name
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.spec.view import InferenceService, ScaleToZero, ScorerWeights

EPP_APP = "quire-endpoint-picker"
EPP_COMPONENT = "endpoint-picker"
HEALTH_PORT = 9003  # gRPC health service (the probes)
METRICS_PORT = 9090  # the picker's own Prometheus metrics
# gcr.io/distroless/static:nonroot, the base of GIE's epp image.
EPP_UID = 65532
CONFIG_DIR = "/config"
CONFIG_FILE = "config.yaml"
# The picker reads its config once at start: a changed config rolls its pod through this hash.
CONFIG_HASH_ANNOTATION = "quire.dev/endpoint-picker-config"
# The gRPC health service name the picker answers while it has synced its pool (one replica,
# no leader election), as GIE's chart probes it.
HEALTH_SERVICE = "inference-extension"
RBAC_API_VERSION = Kind.ROLE.api_version
OBJECTIVES_GROUP = "inference.networking.x-k8s.io"
_POOL = Kind.INFERENCE_POOL

# EndpointPickerConfig plugin types (GIE v1.5.0), with the spec's weight of each scorer.
QUEUE_SCORER = "queue-scorer"
KV_CACHE_SCORER = "kv-cache-utilization-scorer"
PREFIX_CACHE_SCORER = "prefix-cache-scorer"
# Scores 1 where the request's adapter (its body's model) runs, 0.8 where the replica has a free
# adapter slot, 0.6 where the adapter waits, 0 otherwise: read from vllm:lora_requests_info.
LORA_AFFINITY_SCORER = "lora-affinity-scorer"
PICKER = "max-score-picker"
METRICS_SOURCE = "metrics-data-source"
METRICS_EXTRACTOR = "core-metrics-extractor"
# The engine's vllm:cache_config_info label counting device plus host-tier blocks (a replica's
# whole prefix cache): with a host tier the picker sizes its per-replica prefix index from it.
PREFIX_BLOCKS_LABEL = "num_prefix_blocks"
# GIE v1.5.0's built-in metric specs for engine-type vllm (its defaultEngineConfigs): a config
# that names the engine replaces the built-in one whole, so the override repeats them.
VLLM_METRICS = {
    "name": meta.ENGINE_TYPE,
    "queuedRequestsSpec": "vllm:num_requests_waiting",
    "runningRequestsSpec": "vllm:num_requests_running",
    "kvUsageSpec": "vllm:kv_cache_usage_perc",
    "loraSpec": "vllm:lora_requests_info",
    "cacheInfoSpec": "vllm:cache_config_info",
}
# The EndpointPickerConfig feature gate of the flow control layer (the hold queue).
FLOW_CONTROL_GATE = "flowControl"

# What the picker reads in its namespace, and nothing else: its pool, the pods it selects, and
# the optional InferenceObjective/InferenceModelRewrite objects (watched only where installed).
RULES = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [_POOL.group], "resources": [_POOL.plural], "verbs": ["get", "list", "watch"]},
    {
        "apiGroups": [OBJECTIVES_GROUP],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": ["get", "list", "watch"],
    },
)


def epp_labels(name: str) -> dict[str, str]:
    return meta.labels(name, EPP_APP, EPP_COMPONENT)


def _metadata(isvc: InferenceService) -> dict[str, Any]:
    return meta.object_meta(isvc.ref, epp_name(isvc.ref.name), epp_labels(isvc.ref.name))


def endpoint_picker_config(
    weights: ScorerWeights, host_tier: bool = False, lora: bool = False
) -> dict[str, Any]:
    """GIE's default scheduling (its default weights unless the spec sets others), written out:
    the scorers with a weight above 0, the highest total score wins, and the engines' metrics
    scraped from ``/metrics`` with the vLLM metric names.

    ``lora``: the replicas serve adapters (spec.lora), so GIE's LoRA-affinity scorer joins, which
    its default profile leaves out: it reads the ``vllm:lora_requests_info`` the extractor
    already maps (``loraSpec``). Without adapters it is left out (it would score every replica
    alike), so a service without LoRA keeps GIE's own profile and its picker's config.

    ``host_tier``: the replicas keep evicted prefixes in host memory. The prefix scorer's index
    (GIE's approximate prefix cache, ``autoTune`` on by default) keeps an LRU per replica as
    large as the replica's ``num_gpu_blocks``, so it would forget prefixes the replica still
    serves from its tier and send them anywhere; the extractor is pointed at
    ``num_prefix_blocks`` instead (device plus host blocks). GIE v1.5.0 has no scorer that reads
    the tier's usage or hit rate: the index's capacity is what it can weigh."""
    scorers = [
        (kind, weight)
        for kind, weight in (
            (QUEUE_SCORER, weights.queue),
            (KV_CACHE_SCORER, weights.kv_cache_utilization),
            (PREFIX_CACHE_SCORER, weights.prefix_cache),
            (LORA_AFFINITY_SCORER, weights.lora_affinity if lora else 0),
        )
        if weight
    ]
    extractor: dict[str, Any] = {
        "engineLabelKey": meta.ENGINE_TYPE_LABEL,
        "defaultEngine": meta.ENGINE_TYPE,
    }
    if host_tier:
        extractor["engineConfigs"] = [
            {**VLLM_METRICS, "cacheNumBlocksLabelName": PREFIX_BLOCKS_LABEL}
        ]
    return {
        "apiVersion": f"{OBJECTIVES_GROUP}/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            *({"type": kind} for kind, _ in scorers),
            {"type": PICKER},
            {"type": METRICS_SOURCE, "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": METRICS_EXTRACTOR, "parameters": extractor},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    *({"pluginRef": kind, "weight": weight} for kind, weight in scorers),
                    {"pluginRef": PICKER},
                ],
            }
        ],
        "dataLayer": {
            "sources": [
                {"pluginRef": METRICS_SOURCE, "extractors": [{"pluginRef": METRICS_EXTRACTOR}]}
            ]
        },
    }


def flow_control(hold: ScaleToZero) -> dict[str, Any]:
    """The hold queue (GIE v1.5.0 EndpointPickerConfig, switched on by its feature gate, not by
    the deprecated environment variable): with no ready replica a request waits here until one
    is ready (dispatch) or its TTL ends (503); beyond ``maxRequests`` the picker answers 429.
    The default ``utilization-detector`` decides saturation from the engines' vLLM-named
    metrics, which Quire's engine exports."""
    return {
        "featureGates": [FLOW_CONTROL_GATE],
        "flowControl": {
            "maxRequests": hold.queue_size,
            "defaultRequestTTL": f"{hold.hold_timeout_s}s",
        },
    }


def config_text(isvc: InferenceService) -> str:
    config = endpoint_picker_config(
        isvc.routing.weights, bool(isvc.engine.kv_offloading_size_gib), isvc.lora is not None
    )
    if isvc.autoscaling.scales_to_zero:
        config = {**config, **flow_control(isvc.autoscaling.scale_to_zero)}
    return yaml.safe_dump(config, sort_keys=False)


def build_config_map(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(isvc),
        "data": {CONFIG_FILE: config_text(isvc)},
    }


def build_service_account(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(isvc)}


def build_role(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "Role",
        "metadata": _metadata(isvc),
        "rules": [dict(rule) for rule in RULES],
    }


def build_role_binding(isvc: InferenceService) -> dict[str, Any]:
    name = epp_name(isvc.ref.name)
    return {
        "apiVersion": RBAC_API_VERSION,
        "kind": "RoleBinding",
        "metadata": _metadata(isvc),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.ref.namespace}],
    }


def epp_args(isvc: InferenceService) -> list[str]:
    """``epp`` flags: the pool, the config file and the ports explicit; traces and pprof off
    (GIE's chart turns tracing off too; pprof is a debugging aid a hardened pod does without).

    Metrics endpoint auth off: the chart's PodMonitor scrapes the picker's metrics port without
    a token (as it does the engines'), and with auth on the picker would also need TokenReview
    and SubjectAccessReview rights this namespaced Role does not grant. With scale to zero the
    subset filter is off: a Gateway's subset metadata (the endpoints it knew, none at zero)
    would otherwise keep held requests from ever being dispatched to the new replica."""
    ref = isvc.ref
    subset = ["--disable-endpoint-subset-filter"] if isvc.autoscaling.scales_to_zero else []
    return [
        "--pool-name", ref.name,
        "--pool-namespace", ref.namespace,
        "--pool-group", _POOL.group,
        "--config-file", f"{CONFIG_DIR}/{CONFIG_FILE}",
        "--grpc-port", str(EPP_GRPC_PORT),
        "--grpc-health-port", str(HEALTH_PORT),
        "--metrics-port", str(METRICS_PORT),
        "--zap-encoder", "json",
        "--tracing=false",
        "--enable-pprof=false",
        "--metrics-endpoint-auth=false",
        *subset,
    ]  # fmt: skip


def _grpc_probe(period_s: int) -> dict[str, Any]:
    return {"grpc": {"port": HEALTH_PORT, "service": HEALTH_SERVICE}, "periodSeconds": period_s}


def _container(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "epp",
        "image": config.epp_image,
        "args": epp_args(isvc),
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # Serving once the pool and its pods are synced: the readiness probe keeps the Gateway
        # off a picker that knows no endpoints yet.
        "readinessProbe": _grpc_probe(2),
        "livenessProbe": {**_grpc_probe(10), "initialDelaySeconds": 5},
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": container_security(),
    }
    resources: dict[str, Any] = {}
    if isvc.routing.epp_requests:
        resources["requests"] = dict(isvc.routing.epp_requests)
    if isvc.routing.epp_limits:
        resources["limits"] = dict(isvc.routing.epp_limits)
    if resources:
        container["resources"] = resources
    return container


def build_epp_deployment(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """One replica (GIE's recommended layout: the prefix-cache index lives in the picker).
    RollingUpdate with no unavailability: a new picker is ready before the old one stops, so a
    config change or an image upgrade drops no request even under FailClose."""
    name = isvc.ref.name
    digest = hashlib.sha256(config_text(isvc).encode()).hexdigest()[:16]
    pod: dict[str, Any] = {
        "serviceAccountName": epp_name(name),
        # The picker calls the API server (its pool, pods): it needs its token, unlike engines.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        # In-flight streams pass through the picker (ext_proc), so it gets as long to stop as
        # the engines take to drain.
        "terminationGracePeriodSeconds": termination_grace_period_s(isvc),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": EPP_UID,
            "runAsGroup": EPP_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(isvc, config)],
        "volumes": [
            {"name": "config", "configMap": {"name": epp_name(name)}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
        ],
    }
    if isvc.placement.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in isvc.placement.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(isvc),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": meta.selector_labels(name, EPP_APP)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": epp_labels(name),
                    "annotations": {CONFIG_HASH_ANNOTATION: digest},
                },
                "spec": pod,
            },
        },
    }


def build_epp_service(isvc: InferenceService) -> dict[str, Any]:
    """The address the InferencePool's endpointPickerRef names: the Gateway's ext_proc calls go
    to its gRPC port (TLS with the picker's self-signed certificate, GIE's default)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(isvc),
        "spec": {
            "type": "ClusterIP",
            "selector": meta.selector_labels(isvc.ref.name, EPP_APP),
            "ports": [
                {"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": "grpc",
                 "protocol": "TCP"},
                {"name": "http-metrics", "port": METRICS_PORT, "targetPort": "metrics",
                 "protocol": "TCP"},
            ],
        },
    }  # fmt: skip


def routing_children(
    isvc: InferenceService, config: OperatorConfig
) -> list[tuple[meta.ChildKey, dict[str, Any] | None]]:
    """Every routing object in apply order (the picker's identity and RBAC before its pod, the
    pool last, once what it points at exists); each None when routing is off."""
    name, picker = isvc.ref.name, epp_name(isvc.ref.name)
    builders = [
        (Kind.SERVICE_ACCOUNT, picker, lambda: build_service_account(isvc)),
        (Kind.ROLE, picker, lambda: build_role(isvc)),
        (Kind.ROLE_BINDING, picker, lambda: build_role_binding(isvc)),
        (Kind.CONFIG_MAP, picker, lambda: build_config_map(isvc)),
        (Kind.DEPLOYMENT, picker, lambda: build_epp_deployment(isvc, config)),
        (Kind.SERVICE, picker, lambda: build_epp_service(isvc)),
    ]
    children: list[tuple[meta.ChildKey, dict[str, Any] | None]] = [
        (meta.ChildKey(kind, child), build() if isvc.routing.enabled else None)
        for kind, child, build in builders
    ]
    children.append((meta.ChildKey(Kind.INFERENCE_POOL, name), build_inference_pool(isvc)))
    return children
