"""Unit tests of the routing builders: spec.routing -> InferencePool and Endpoint Picker objects.

No cluster: specs are defaulted from the CRD file itself (``helpers.with_defaults``), exactly as
the API server stores them, and every assertion is on exact values. The GIE facts these objects
rest on (v1.5.0: flags, ports, plugin types, RBAC, the engine-type label) are in the module
docstrings of builders/inference_pool.py and builders/endpoint_picker.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from quire_operator import meta
from quire_operator.builders.deployment import build_deployment
from quire_operator.builders.endpoint_picker import (
    build_config_map,
    build_epp_deployment,
    build_epp_service,
    build_role,
    build_role_binding,
    build_service_account,
    config_text,
    endpoint_picker_config,
    routing_children,
)
from quire_operator.builders.inference_pool import build_inference_pool
from quire_operator.config import DEFAULT_EPP_IMAGE, GIE_VERSION, OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.meta import ChildKey
from quire_operator.spec.parsing import parse, read
from quire_operator.spec.view import (
    FailureMode,
    InferenceService,
    InvalidSpec,
    RoutingMode,
    ScorerWeights,
)
from tests.operator_tests.helpers import inference_service, load_example
from tests.operator_tests.test_builders import METADATA, UID

OWNER = METADATA["ownerReferences"][0]
EPP_LABELS = {
    "app.kubernetes.io/name": "quire-endpoint-picker",
    "app.kubernetes.io/instance": "tiny",
    "app.kubernetes.io/component": "endpoint-picker",
    "app.kubernetes.io/part-of": "quire",
    "app.kubernetes.io/managed-by": "quire-operator",
}
EPP_SELECTOR = {
    "app.kubernetes.io/name": "quire-endpoint-picker",
    "app.kubernetes.io/instance": "tiny",
}
EPP_METADATA = {
    "name": "tiny-epp",
    "namespace": "ml",
    "labels": EPP_LABELS,
    "ownerReferences": [OWNER],
}
EPP_IMAGE = f"registry.k8s.io/gateway-api-inference-extension/epp:{GIE_VERSION}"
ENGINE_SELECTOR = {"app.kubernetes.io/name": "quire-engine", "app.kubernetes.io/instance": "tiny"}

# GIE v1.5.0's default scheduling config, as its chart writes it, in our words (no LoRA: its
# LoRA-affinity scorer joins only with spec.lora).
DEFAULT_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
- type: metrics-data-source
  parameters:
    scheme: http
    path: /metrics
- type: core-metrics-extractor
  parameters:
    engineLabelKey: inference.networking.k8s.io/engine-type
    defaultEngine: vllm
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
"""


def routed(routing: dict[str, Any] | None = None, **changes: Any) -> InferenceService:
    """The example (name tiny, namespace ml) with routing on, plus ``routing`` settings."""
    spec = {**load_example()["spec"], **changes}
    spec["routing"] = {"mode": "InferencePool", **(routing or {})}
    return parse(inference_service(spec, name="tiny", uid=UID))


def unrouted() -> InferenceService:
    return parse(inference_service(load_example()["spec"], name="tiny", uid=UID))


def test_routing_is_off_by_default_and_builds_nothing() -> None:
    isvc = unrouted()
    assert isvc.routing.mode is RoutingMode.SERVICE
    assert build_inference_pool(isvc) is None
    # Every routing object is named, so the reconciler deletes those it owns.
    assert routing_children(isvc, OperatorConfig()) == [
        (ChildKey(Kind.SERVICE_ACCOUNT, "tiny-epp"), None),
        (ChildKey(Kind.ROLE, "tiny-epp"), None),
        (ChildKey(Kind.ROLE_BINDING, "tiny-epp"), None),
        (ChildKey(Kind.CONFIG_MAP, "tiny-epp"), None),
        (ChildKey(Kind.DEPLOYMENT, "tiny-epp"), None),
        (ChildKey(Kind.SERVICE, "tiny-epp"), None),
        (ChildKey(Kind.INFERENCE_POOL, "tiny"), None),
    ]


def test_crd_defaults_are_gies() -> None:
    routing = routed().routing
    assert routing.failure_mode is FailureMode.FAIL_CLOSE
    assert routing.weights == ScorerWeights(
        queue=2, kv_cache_utilization=2, prefix_cache=3, lora_affinity=3
    )
    assert routing.epp_requests == {"cpu": "500m", "memory": "512Mi"}
    assert routing.epp_limits == {"memory": "2Gi"}


def test_inference_pool_is_exactly_this() -> None:
    assert build_inference_pool(routed()) == {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "tiny",
            "namespace": "ml",
            "labels": meta.labels("tiny"),
            "ownerReferences": [OWNER],
        },
        "spec": {
            "selector": {"matchLabels": ENGINE_SELECTOR},
            "targetPorts": [{"number": 8000}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": "tiny-epp",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    }


def test_pool_selects_exactly_the_engine_pods_and_never_the_pickers() -> None:
    isvc = routed()
    pool = build_inference_pool(isvc)
    assert pool is not None
    selector = pool["spec"]["selector"]["matchLabels"]
    engine = build_deployment(isvc, OperatorConfig())
    # The engine Deployment's own (immutable) selector, which its pods carry...
    assert selector == engine["spec"]["selector"]["matchLabels"]
    assert selector.items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    # ...and the picker's pods do not (nor does any other InferenceService's, by instance).
    picker = build_epp_deployment(isvc, OperatorConfig())
    assert not selector.items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    other = build_inference_pool(parse(inference_service(
        {**load_example()["spec"], "routing": {"mode": "InferencePool"}}, name="tiny-2", uid=UID
    )))  # fmt: skip
    assert other is not None
    assert other["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "tiny-2"
    # The port the pool sends requests to is the engine container's.
    (port,) = engine["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]


def test_engine_pods_carry_the_vllm_engine_type_label_with_or_without_routing() -> None:
    for isvc in (routed(), unrouted()):
        labels = build_deployment(isvc, OperatorConfig())["spec"]["template"]["metadata"]["labels"]
        assert labels["inference.networking.k8s.io/engine-type"] == "vllm"


def test_failure_mode_follows_the_spec() -> None:
    pool = build_inference_pool(routed({"failureMode": "FailOpen"}))
    assert pool is not None
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_endpoint_picker_deployment_is_exactly_this() -> None:
    isvc = routed()
    grpc = {"port": 9003, "service": "inference-extension"}
    assert build_epp_deployment(isvc, OperatorConfig()) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": EPP_METADATA,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": EPP_SELECTOR},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": EPP_LABELS,
                    "annotations": {"quire.dev/endpoint-picker-config": "9241faa26adfc43e"},
                },
                "spec": {
                    "serviceAccountName": "tiny-epp",
                    "automountServiceAccountToken": True,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 40,  # the engines' drain: 5 + 30 + 5
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "epp",
                            "image": EPP_IMAGE,
                            "args": [
                                "--pool-name", "tiny",
                                "--pool-namespace", "ml",
                                "--pool-group", "inference.networking.k8s.io",
                                "--config-file", "/config/config.yaml",
                                "--grpc-port", "9002",
                                "--grpc-health-port", "9003",
                                "--metrics-port", "9090",
                                "--zap-encoder", "json",
                                "--tracing=false",
                                "--enable-pprof=false",
                                "--metrics-endpoint-auth=false",
                            ],
                            "env": [
                                {"name": "NAMESPACE",
                                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                                {"name": "POD_NAME",
                                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": 9002, "protocol": "TCP"},
                                {"name": "grpc-health", "containerPort": 9003, "protocol": "TCP"},
                                {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
                            ],
                            "readinessProbe": {"grpc": grpc, "periodSeconds": 2},
                            "livenessProbe": {
                                "grpc": grpc, "periodSeconds": 10, "initialDelaySeconds": 5,
                            },
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/config", "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "resources": {
                                "requests": {"cpu": "500m", "memory": "512Mi"},
                                "limits": {"memory": "2Gi"},
                            },
                        }
                    ],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "tiny-epp"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }  # fmt: skip


def test_picker_image_resources_and_pull_secrets_follow_settings_and_spec() -> None:
    resources = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    isvc = routed(
        {"endpointPicker": {"resources": resources}}, imagePullSecrets=[{"name": "mirror"}]
    )
    config = OperatorConfig(epp_image="mirror.example.com/gie/epp:v1.5.0")
    pod = build_epp_deployment(isvc, config)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "mirror.example.com/gie/epp:v1.5.0"
    assert container["resources"] == resources
    assert pod["imagePullSecrets"] == [{"name": "mirror"}]
    assert OperatorConfig().epp_image == DEFAULT_EPP_IMAGE
    with pytest.raises(ValueError, match="epp_image must not be empty"):
        OperatorConfig(epp_image="")


def test_endpoint_picker_service_is_exactly_this() -> None:
    assert build_epp_service(routed()) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": EPP_METADATA,
        "spec": {
            "type": "ClusterIP",
            "selector": EPP_SELECTOR,
            "ports": [
                {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "http-metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def test_service_account_role_and_binding_are_exactly_these() -> None:
    isvc = routed()
    assert build_service_account(isvc) == {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": EPP_METADATA,
    }
    read = ["get", "list", "watch"]
    # Exactly what GIE v1.5.0's chart grants its picker in the pool's namespace (no leader
    # election, no metrics-auth ClusterRole): nothing to write, nothing cluster-wide.
    assert build_role(isvc) == {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": EPP_METADATA,
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            {
                "apiGroups": ["inference.networking.k8s.io"],
                "resources": ["inferencepools"],
                "verbs": read,
            },
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferenceobjectives", "inferencemodelrewrites"],
                "verbs": read,
            },
        ],
    }
    assert build_role_binding(isvc) == {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": EPP_METADATA,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tiny-epp"},
        "subjects": [{"kind": "ServiceAccount", "name": "tiny-epp", "namespace": "ml"}],
    }


def test_config_map_holds_gies_default_config() -> None:
    assert build_config_map(routed()) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": EPP_METADATA,
        "data": {"config.yaml": DEFAULT_CONFIG},
    }


def test_weights_change_the_config_and_roll_the_picker() -> None:
    weights = {"queue": 5, "kvCacheUtilization": 0, "prefixCache": 1, "loraAffinity": 0}
    isvc = routed({"scorerWeights": weights})
    config = yaml.safe_load(build_config_map(isvc)["data"]["config.yaml"])
    # A weight of 0 leaves its scorer out of both the plugins and the profile.
    assert [p["type"] for p in config["plugins"]] == [
        "queue-scorer",
        "prefix-cache-scorer",
        "max-score-picker",
        "metrics-data-source",
        "core-metrics-extractor",
    ]
    assert config["schedulingProfiles"] == [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 5},
                {"pluginRef": "prefix-cache-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ]
    # The picker reads its config once at start: the pod template's hash moves with it.
    annotation = "quire.dev/endpoint-picker-config"

    def digest(service: InferenceService) -> str:
        template = build_epp_deployment(service, OperatorConfig())["spec"]["template"]
        return str(template["metadata"]["annotations"][annotation])

    assert digest(isvc) != digest(routed())
    assert digest(routed()) == digest(routed())


def test_lora_affinity_is_weighted_like_the_others_and_0_leaves_it_out() -> None:
    def profile(weights: dict[str, int]) -> list[dict[str, Any]]:
        config = yaml.safe_load(config_text(routed({"scorerWeights": weights}, lora={})))
        assert config["plugins"][-3]["type"] == "max-score-picker"
        types = [p["type"] for p in config["plugins"][:-3]]
        (default,) = config["schedulingProfiles"]
        assert [p["pluginRef"] for p in default["plugins"][:-1]] == types
        return list(default["plugins"][:-1])

    # The spec's other weights set, loraAffinity not: the CRD's default (3) applies.
    assert profile({"queue": 1, "kvCacheUtilization": 0, "prefixCache": 0}) == [
        {"pluginRef": "queue-scorer", "weight": 1},
        {"pluginRef": "lora-affinity-scorer", "weight": 3},
    ]
    assert profile({"loraAffinity": 7})[-1] == {"pluginRef": "lora-affinity-scorer", "weight": 7}
    # Alone, it is a whole profile: base-model requests then score alike and spread at random.
    assert profile({"queue": 0, "kvCacheUtilization": 0, "prefixCache": 0, "loraAffinity": 1}) == [
        {"pluginRef": "lora-affinity-scorer", "weight": 1}
    ]
    weightless = routed({"scorerWeights": {"loraAffinity": 0}}, lora={})
    assert "lora-affinity-scorer" not in config_text(weightless)
    # Without spec.lora it is left out whatever its weight (every replica would score alike), and
    # a profile of it alone is refused.
    assert "lora-affinity-scorer" not in config_text(routed({"scorerWeights": {"loraAffinity": 7}}))
    alone = {"queue": 0, "kvCacheUtilization": 0, "prefixCache": 0, "loraAffinity": 1}
    spec = {**load_example()["spec"], "routing": {"mode": "InferencePool", "scorerWeights": alone}}
    refused = read(inference_service(spec, name="tiny", uid=UID))
    assert isinstance(refused, InvalidSpec) and "only loraAffinity is above 0" in refused.error
    # It reads vllm:lora_requests_info, which the extractor maps for engine-type vllm by default
    # (and in the host tier's override, which repeats every spec).
    tiered = endpoint_picker_config(ScorerWeights(), host_tier=True)
    (override,) = tiered["plugins"][-1]["parameters"]["engineConfigs"]
    assert override["loraSpec"] == "vllm:lora_requests_info"


def test_every_plugin_a_profile_names_is_declared() -> None:
    for weights in (
        ScorerWeights(),
        ScorerWeights(0, 0, 1, 0),
        ScorerWeights(1, 1, 0),
        ScorerWeights(0, 0, 0, 1),
    ):
        config = endpoint_picker_config(weights, lora=True)
        declared = {p["type"] for p in config["plugins"]}
        (profile,) = config["schedulingProfiles"]
        assert {p["pluginRef"] for p in profile["plugins"]} <= declared
        source = config["dataLayer"]["sources"][0]
        assert {source["pluginRef"], source["extractors"][0]["pluginRef"]} <= declared


def test_routing_objects_come_in_apply_order_with_the_pool_last() -> None:
    children = routing_children(routed(), OperatorConfig())
    assert [key for key, _ in children] == [
        ChildKey(Kind.SERVICE_ACCOUNT, "tiny-epp"),
        ChildKey(Kind.ROLE, "tiny-epp"),
        ChildKey(Kind.ROLE_BINDING, "tiny-epp"),
        ChildKey(Kind.CONFIG_MAP, "tiny-epp"),
        ChildKey(Kind.DEPLOYMENT, "tiny-epp"),
        ChildKey(Kind.SERVICE, "tiny-epp"),
        ChildKey(Kind.INFERENCE_POOL, "tiny"),
    ]
    for key, obj in children:
        assert obj is not None
        assert (obj["kind"], obj["metadata"]["name"]) == key
        assert obj["metadata"]["ownerReferences"] == [OWNER]
        assert obj["metadata"]["labels"][meta.MANAGED_BY_LABEL] == meta.FIELD_MANAGER
        assert obj["metadata"]["labels"][meta.INSTANCE_LABEL] == "tiny"


def test_routing_invariants_are_checked_without_the_crd() -> None:
    with pytest.raises(ValueError, match="at least one weight must be above 0"):
        ScorerWeights(0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"must be 0\.\.100"):
        ScorerWeights(queue=101)
    with pytest.raises(ValueError, match=r"must be 0\.\.100"):
        ScorerWeights(lora_affinity=-1)
    long_name = "a" * 60
    spec = {**load_example()["spec"], "routing": {"mode": "InferencePool"}}
    with pytest.raises(ValueError, match="at most 59 characters"):
        parse(inference_service(spec, name=long_name))
    # Without routing the name may use all 63 characters.
    assert parse(inference_service(load_example()["spec"], name="a" * 63)).routing.enabled is False


def test_a_spec_stored_before_routing_existed_reads_as_routing_off() -> None:
    body = inference_service(load_example()["spec"], name="tiny", uid=UID)
    del body["spec"]["routing"]
    assert parse(body).routing.mode is RoutingMode.SERVICE
