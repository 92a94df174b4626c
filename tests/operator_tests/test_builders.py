"""Unit tests of the pure parts of the operator: spec parsing and the object builders.

No cluster: specs are defaulted from the CRD file itself (``helpers.with_defaults``), exactly as
the API server stores them, and every assertion is on exact values.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from quire_operator.builders.deployment import (
    API_KEY_ENV,
    REFUSED_FLAGS,
    build_deployment,
    engine_args,
)
from quire_operator.builders.disruption_budget import build_pdb
from quire_operator.builders.hpa import build_hpa, quantity
from quire_operator.builders.service import build_service
from quire_operator.config import OperatorConfig
from quire_operator.spec.parsing import parse
from quire_operator.spec.view import InferenceService, ModelKind
from tests.operator_tests.helpers import inference_service, load_crd, load_example

UID = "0b5c8a5e-1111-4222-8333-944455556666"
LABELS = {
    "app.kubernetes.io/name": "quire-engine",
    "app.kubernetes.io/instance": "tiny",
    "app.kubernetes.io/component": "inference-server",
    "app.kubernetes.io/part-of": "quire",
    "app.kubernetes.io/managed-by": "quire-operator",
}
SELECTOR = {"app.kubernetes.io/name": "quire-engine", "app.kubernetes.io/instance": "tiny"}
METADATA: dict[str, Any] = {
    "name": "tiny",
    "namespace": "ml",
    "labels": LABELS,
    "ownerReferences": [
        {
            "apiVersion": "quire.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "tiny",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ],
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def isvc(spec: dict[str, Any] | None = None, **changes: Any) -> InferenceService:
    """The example manifest (name tiny, namespace ml), with top-level spec keys replaced."""
    base = load_example()["spec"] if spec is None else spec
    return parse(inference_service({**base, **changes}, name="tiny", uid=UID))


# The flags every tiny-model GPU service starts with: model, name, address, device.
TINY_ON_GPU = [
    "serve",
    "--model", "tiny",
    "--served-model-name", "tiny",
    "--host", "0.0.0.0",
    "--port", "8000",
    "--device", "cuda",
]  # fmt: skip


def example_args() -> list[str]:
    return [
        *TINY_ON_GPU,
        "--dtype", "auto",
        "--kv-cache-dtype", "auto",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256",
        "--enable-prefix-caching",
        "--preemption-mode", "recompute",
        "--kv-offloading-size", "0",
        "--log-format", "json",
        "--shutdown-timeout", "30",
    ]  # fmt: skip


HARDENED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
SCRATCH_MOUNTS = [
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "home", "mountPath": "/home/quire"},
]
SCRATCH_VOLUMES = [
    {"name": "tmp", "emptyDir": {"sizeLimit": "4Gi"}},
    {"name": "home", "emptyDir": {"sizeLimit": "1Gi"}},
]
SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}


def test_example_deployment_is_exactly_this() -> None:
    probe = {"periodSeconds": 10, "timeoutSeconds": 5}
    assert build_deployment(isvc(), OperatorConfig()) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": METADATA,
        "spec": {
            # No "replicas": autoscaling is on, so the HPA is the field's only owner.
            "selector": {"matchLabels": SELECTOR},
            "progressDeadlineSeconds": 3600,
            "template": {
                "metadata": {
                    # The engine-type label picks the vLLM metric names in GIE's Endpoint Picker.
                    "labels": {**LABELS, "inference.networking.k8s.io/engine-type": "vllm"},
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": "8000",
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    # preStop 5 s + drain 30 s + margin 5 s
                    "terminationGracePeriodSeconds": 40,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "runAsGroup": 10001,
                        "fsGroup": 10001,
                        "fsGroupChangePolicy": "OnRootMismatch",
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "engine",
                            "image": "quire-engine:0.1.0",
                            "command": ["quire-engine"],
                            "args": example_args(),
                            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                            "startupProbe": {
                                "httpGet": {"path": "/ready", "port": "http"},
                                **probe,
                                "failureThreshold": 360,
                            },
                            "readinessProbe": {
                                "httpGet": {"path": "/ready", "port": "http"},
                                "periodSeconds": 5,
                                "timeoutSeconds": 5,
                                "failureThreshold": 3,
                            },
                            "livenessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                **probe,
                                "failureThreshold": 6,
                            },
                            "volumeMounts": [
                                {"name": "dshm", "mountPath": "/dev/shm"},
                                *SCRATCH_MOUNTS,
                            ],
                            "securityContext": HARDENED,
                            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                    "volumes": [SHM_VOLUME, *SCRATCH_VOLUMES],
                    "tolerations": [GPU_TOLERATION],
                },
            },
        },
    }


def test_replicas_are_applied_only_when_autoscaling_is_off() -> None:
    off = isvc(autoscaling={"enabled": False}, replicas=3)
    assert build_deployment(off, OperatorConfig())["spec"]["replicas"] == 3
    assert "replicas" not in build_deployment(isvc(replicas=3), OperatorConfig())["spec"]
    # Zero parks the service without deleting it.
    parked = isvc(autoscaling={"enabled": False}, replicas=0)
    assert build_deployment(parked, OperatorConfig())["spec"]["replicas"] == 0


def test_engine_settings_become_flags() -> None:
    engine = {
        "blockSize": 32,
        "gpuMemoryUtilization": 0.85,
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 8192,
        "maxModelLen": 4096,
        "enablePrefixCaching": False,
        "preemptionMode": "swap",
        "swapSpaceGiB": 8.5,
        "dtype": "bfloat16",
        "kvCacheDtype": "fp8",
        "kvOffloadingSizeGiB": 16,
        "extraArgs": ["--max-waiting", "128", "--seed=7"],
    }
    assert engine_args(isvc(engine=engine)) == [
        *TINY_ON_GPU,
        "--dtype", "bfloat16",
        "--kv-cache-dtype", "fp8",
        "--block-size", "32",
        "--gpu-memory-utilization", "0.85",
        "--max-num-seqs", "64",
        "--no-enable-prefix-caching",
        "--preemption-mode", "swap",
        "--kv-offloading-size", "16",
        "--log-format", "json",
        "--shutdown-timeout", "30",
        "--max-num-batched-tokens", "8192",
        "--max-model-len", "4096",
        "--swap-space", "8.5",
        # extraArgs last, as written: argv, never a shell string.
        "--max-waiting", "128", "--seed=7",
    ]  # fmt: skip


@pytest.mark.slow
def test_engine_args_parse_with_the_engines_own_parser() -> None:
    # The contract with engine/quire_engine/server/cli.py: every flag the builder writes exists
    # there and reads back as the spec's value (this imports the engine, hence torch: seconds).
    serve = pytest.importorskip("quire_engine.server.cli")
    engine = {"blockSize": 64, "preemptionMode": "swap", "swapSpaceGiB": 2, "maxModelLen": 2048}
    service = isvc(
        engine=engine, model={"uri": "hf://org/model", "servedName": "chat"}, resources={"gpus": 0}
    )
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(engine_args(service)[1:])  # [0] is the "serve" subcommand
    assert (args.model, args.served_model_name, args.host, args.port) == (
        "/models/org/model",
        ["chat"],
        "0.0.0.0",
        8000,
    )
    assert (args.device, args.dtype, args.block_size, args.gpu_memory_utilization) == (
        "cpu",
        "auto",
        64,
        0.9,
    )
    assert (args.max_num_seqs, args.enable_prefix_caching, args.preemption_mode) == (
        256,
        True,
        "swap",
    )
    assert (args.swap_space, args.max_model_len, args.log_format) == (2.0, 2048, "json")
    assert args.shutdown_timeout == 30  # the drain the pod's grace period is sized for
    # The API key's variable (deployment.API_KEY_ENV) is the engine's env name of --api-key.
    assert serve.env_name("--api-key") == API_KEY_ENV


def test_refused_flags_match_the_crd_rule_on_extra_args() -> None:
    (version,) = load_crd()["spec"]["versions"]
    engine = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    (rule,) = engine["properties"]["extraArgs"]["x-kubernetes-validations"]
    assert tuple(re.findall(r"'(--[a-z-]+)'", rule["rule"])) == REFUSED_FLAGS


def test_api_key_comes_from_the_secret_as_an_env_var_only() -> None:
    protected = isvc(apiKeySecretRef={"name": "llm-key"})
    (container,) = build_deployment(protected, OperatorConfig())["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["env"] == [
        {
            "name": "QUIRE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "api-key"}},
        }
    ]
    assert not any("api-key" in arg or "llm-key" in arg for arg in container["args"])
    assert (
        "env"
        not in build_deployment(isvc(), OperatorConfig())["spec"]["template"]["spec"]["containers"][
            0
        ]
    )


def test_shutdown_fields_set_the_drain_the_pre_stop_sleep_and_the_grace_period() -> None:
    engine = {"shutdownTimeoutSeconds": 120, "preStopDelaySeconds": 10}
    pod = build_deployment(isvc(engine=engine), OperatorConfig())["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][container["args"].index("--shutdown-timeout") + 1] == "120"
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    assert pod["terminationGracePeriodSeconds"] == 10 + 120 + 5
    # No delay: no lifecycle hook at all, and the grace period is the drain plus the margin.
    engine = {"shutdownTimeoutSeconds": 0, "preStopDelaySeconds": 0}
    pod = build_deployment(isvc(engine=engine), OperatorConfig())["spec"]["template"]["spec"]
    assert "lifecycle" not in pod["containers"][0]
    assert pod["terminationGracePeriodSeconds"] == 5


def test_shared_memory_limit_is_the_spec_quantity() -> None:
    sized = isvc(resources={"gpus": 1, "sharedMemory": "8Gi"})
    volumes = build_deployment(sized, OperatorConfig())["spec"]["template"]["spec"]["volumes"]
    assert volumes[0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}


def test_cpu_only_service_has_no_gpu_limit_or_toleration() -> None:
    cpu = isvc(resources={"gpus": 0, "requests": {"cpu": "2", "memory": "4Gi"}})
    pod = build_deployment(cpu, OperatorConfig())["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    assert "tolerations" not in pod


def test_mig_resource_is_requested_and_both_taints_tolerated() -> None:
    mig = isvc(
        resources={
            "gpus": 2,
            "gpuResourceName": "nvidia.com/mig-1g.10gb",
            "limits": {"cpu": 8, "memory": "32Gi"},
        },
        tolerations=[GPU_TOLERATION, {"key": "spot", "operator": "Exists"}],
    )
    pod = build_deployment(mig, OperatorConfig())["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {
        "limits": {"cpu": 8, "memory": "32Gi", "nvidia.com/mig-1g.10gb": "2"}
    }
    # The GPU taint, the resource's own, then the user's (a duplicate of ours is dropped).
    assert pod["tolerations"] == [
        GPU_TOLERATION,
        {"key": "nvidia.com/mig-1g.10gb", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Exists"},
    ]


def test_hf_model_is_downloaded_by_an_init_container_with_the_secret_token() -> None:
    model = {
        "uri": "hf://meta-llama/Llama-3.2-1B-Instruct",
        "revision": "main",
        "hfTokenSecretRef": {"name": "hf"},
    }
    deployment = build_deployment(isvc(model=model), OperatorConfig(engine_image="reg/e:1"))
    pod = deployment["spec"]["template"]["spec"]
    assert pod["initContainers"] == [
        {
            "name": "download-model",
            "image": "reg/e:1",
            "command": [
                *("hf", "download", "meta-llama/Llama-3.2-1B-Instruct"),
                *("--local-dir", "/models/meta-llama/Llama-3.2-1B-Instruct"),
                *("--revision", "main"),
            ],
            "env": [
                {"name": "HF_HOME", "value": "/models/.hf-home"},
                {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
                },
            ],
            "volumeMounts": [{"name": "model", "mountPath": "/models"}, *SCRATCH_MOUNTS],
            "securityContext": HARDENED,
        }
    ]
    assert pod["volumes"] == [SHM_VOLUME, *SCRATCH_VOLUMES, {"name": "model", "emptyDir": {}}]
    (engine,) = pod["containers"]
    assert engine["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        *SCRATCH_MOUNTS,
        {"name": "model", "mountPath": "/models"},
    ]
    assert engine["args"][1:5] == [
        "--model",
        "/models/meta-llama/Llama-3.2-1B-Instruct",
        "--served-model-name",
        "tiny",  # no servedName: the InferenceService's name
    ]
    assert "env" not in engine  # the token never reaches the serving container


@pytest.mark.parametrize(
    ("uri", "model_arg", "claim"),
    [
        ("pvc://weights/llama/8b", "/models/llama/8b", "weights"),
        ("pvc://weights", "/models", "weights"),
    ],
)
def test_pvc_model_is_mounted_read_only(uri: str, model_arg: str, claim: str) -> None:
    pod = build_deployment(isvc(model={"uri": uri}), OperatorConfig())["spec"]["template"]["spec"]
    assert pod["volumes"][-1] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
    }
    (engine,) = pod["containers"]
    assert engine["volumeMounts"][-1] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert engine["args"][2] == model_arg
    assert "initContainers" not in pod


def test_model_uris_parse_to_their_kinds() -> None:
    cases = {
        "tiny": (ModelKind.TINY, "tiny", ""),
        "hf://Qwen/Qwen2.5-0.5B": (ModelKind.HF, "Qwen/Qwen2.5-0.5B", ""),
        "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf": (
            ModelKind.HF,
            "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
            "qwen2.5-0.5b-instruct-q4_k_m.gguf",
        ),
        "pvc://models/gguf/m.gguf": (ModelKind.PVC, "models", "gguf/m.gguf"),
        "pvc://models/a/b": (ModelKind.PVC, "models", "a/b"),
        "pvc://models/": (ModelKind.PVC, "models", ""),
        "file:///opt/model": (ModelKind.FILE, "/opt/model", ""),
    }
    for uri, expected in cases.items():
        model = isvc(model={"uri": uri}).model
        assert (model.kind, model.location, model.sub_path) == expected, uri
    # One file of a repository is a GGUF file at its root, nothing else.
    for uri in ("s3://bucket/x", "hf://a/b/config.json", "hf://a/b/sub/m.gguf"):
        with pytest.raises(ValueError, match=r"model.uri: not hf://org/name\[/file.gguf\]"):
            isvc(model={"uri": uri})
    with pytest.raises(ValueError, match="hfTokenSecretRef applies only to hf:// models"):
        isvc(model={"uri": "tiny", "hfTokenSecretRef": {"name": "x"}})


def test_placement_is_passed_through() -> None:
    affinity: dict[str, dict[str, list[object]]] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    }
    placed = isvc(
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        affinity=affinity,
        priorityClassName="inference",
        serviceAccountName="engine",
        imagePullSecrets=[{"name": "registry"}],
        engine={"image": "mine:2", "imagePullPolicy": "Always"},
    )
    pod = build_deployment(placed, OperatorConfig())["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["affinity"] == affinity
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("inference", "engine")
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    (engine,) = pod["containers"]
    assert (engine["image"], engine["imagePullPolicy"]) == ("mine:2", "Always")


def test_service_is_exactly_this() -> None:
    assert build_service(isvc(service={"type": "LoadBalancer", "port": 80})) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": METADATA,
        "spec": {
            "type": "LoadBalancer",
            "selector": SELECTOR,
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pods_metric(name: str, average: str) -> dict[str, Any]:
    target = {"type": "AverageValue", "averageValue": average}
    return {"type": "Pods", "pods": {"metric": {"name": name}, "target": target}}


def test_example_hpa_is_exactly_this() -> None:
    assert build_hpa(isvc()) == {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": METADATA,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny"},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                pods_metric("quire_kv_cache_usage_ratio", "800m"),
                pods_metric("quire_num_requests_waiting", "8"),
            ],
            # The CRD's defaults: scale up at once, scale down one replica per 2 minutes after
            # 10 quiet minutes.
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "selectPolicy": "Max",
                    "policies": [
                        {"type": "Percent", "value": 100, "periodSeconds": 30},
                        {"type": "Pods", "value": 2, "periodSeconds": 30},
                    ],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": 600,
                    "selectPolicy": "Max",
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                },
            },
        },
    }


def test_hpa_has_only_the_metrics_with_targets_and_the_given_behavior() -> None:
    scale_down = {"stabilizationWindowSeconds": 60, "policies": []}
    autoscaling = {
        "enabled": True,
        "minReplicas": 2,
        "maxReplicas": 10,
        "targetPreemptionRate": 0.25,
        "behavior": {"scaleDown": scale_down},
    }
    hpa = build_hpa(isvc(autoscaling=autoscaling))
    assert hpa is not None
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert hpa["spec"]["metrics"] == [pods_metric("quire_preemptions_per_second", "250m")]
    # A direction the user gave is theirs; the other keeps the CRD's default.
    assert hpa["spec"]["behavior"]["scaleDown"] == scale_down
    assert hpa["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert build_hpa(isvc(autoscaling={"enabled": False})) is None


def test_pdb_exists_only_when_there_can_be_more_than_one_replica() -> None:
    assert build_pdb(isvc()) == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": METADATA,
        "spec": {
            "selector": {"matchLabels": SELECTOR},
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    assert build_pdb(isvc(autoscaling={"enabled": False}, replicas=1)) is None
    assert build_pdb(isvc(autoscaling={"enabled": False}, replicas=2)) is not None
    single = {"enabled": True, "maxReplicas": 1, "targetQueueDepth": 4}
    assert build_pdb(isvc(autoscaling=single)) is None


def test_quantities_are_canonical() -> None:
    assert [quantity(v) for v in (4, 4.0, 0.8, 0.05, 1.5, 0.0005, 12.25)] == [
        "4",
        "4",
        "800m",
        "50m",
        "1500m",
        "500u",
        "12250m",
    ]


def test_spec_invariants_are_checked_without_the_crd() -> None:
    # The CRD rejects these first; the parser still refuses them for objects that skipped it.
    with pytest.raises(ValueError, match="maxReplicas is required"):
        isvc(autoscaling={"enabled": True, "minReplicas": 1, "targetQueueDepth": 1})
    with pytest.raises(ValueError, match="minReplicas must not exceed maxReplicas"):
        isvc(
            autoscaling={"enabled": True, "minReplicas": 3, "maxReplicas": 2, "targetQueueDepth": 1}
        )
    with pytest.raises(ValueError, match=r"power of two, 1\.\.256: 24"):
        isvc(engine={"blockSize": 24})
    with pytest.raises(ValueError, match=r"gpuMemoryUtilization must be in \(0, 1\]: 1.5"):
        isvc(engine={"gpuMemoryUtilization": 1.5})
