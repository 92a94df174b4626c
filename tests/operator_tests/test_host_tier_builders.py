"""Unit tests of what the operator does for the KV host tier (``spec.engine.kvOffloadingSizeGiB``):
the engine pods' memory sized for it, the status that shows it (with its warning and Event), and
the Endpoint Picker's prefix index pointed at the engine's device-plus-host block count. Exact
values, no cluster; the routed end-to-end scenario is in tests/e2e/test_routing.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from quire_operator.builders.deployment import build_deployment
from quire_operator.builders.endpoint_picker import PREFIX_BLOCKS_LABEL, build_config_map
from quire_operator.builders.host_memory import bytes_quantity, quantity_bytes
from quire_operator.builders.leader_worker_set import build_leader_worker_set
from quire_operator.config import OperatorConfig
from quire_operator.reconcile.observe import _host_tier
from quire_operator.status.conditions import HostTierObservation, Observation, build_status
from quire_operator.status.events import WARNING, Transition, transitions
from tests.operator_tests.test_builders import isvc
from tests.operator_tests.test_routing_builders import routed

CONFIG = OperatorConfig()
GIB = 1 << 30


def engine_resources(body: dict[str, Any]) -> dict[str, Any]:
    resources: dict[str, Any] = body["spec"]["template"]["spec"]["containers"][0]["resources"]
    return resources


@pytest.mark.parametrize(
    ("written", "size"),
    [
        ("512Mi", 512 << 20),
        ("2Gi", 2 * GIB),
        ("1.5Gi", 3 * (GIB // 2)),
        ("1G", 10**9),
        ("1e9", 10**9),
        ("128974848", 128974848),
        (4096, 4096),
        ("1500m", 2),  # millibytes round up, as the API server rounds memory
    ],
)
def test_memory_quantities_read_as_bytes(written: str | int, size: int) -> None:
    assert quantity_bytes(written) == size


def test_bytes_read_back_as_the_shortest_exact_quantity() -> None:
    assert [bytes_quantity(n) for n in (9 * GIB, 272 << 20, 3 << 10, 1000)] == [
        "9Gi",
        "272Mi",
        "3Ki",
        "1000",
    ]
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity_bytes("12 GB")


def test_the_tier_is_added_to_the_memory_request_and_limit() -> None:
    # The engine asks for 2Gi and is limited at 4Gi; a 16 GiB tier goes on top of both.
    resources = {"gpus": 0, "requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
    service = isvc(engine={"kvOffloadingSizeGiB": 16}, resources=resources)
    assert engine_resources(build_deployment(service, CONFIG)) == {
        "requests": {"cpu": "1", "memory": "18Gi"},
        "limits": {"memory": "20Gi"},
    }
    # Without a tier the resources are the spec's, as written.
    assert engine_resources(build_deployment(isvc(resources=resources), CONFIG)) == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"memory": "4Gi"},
    }


def test_without_memory_in_the_spec_the_request_is_the_tier_and_no_limit_appears() -> None:
    service = isvc(
        engine={"kvOffloadingSizeGiB": 0.25}, resources={"gpus": 0, "requests": {"cpu": 2}}
    )
    assert engine_resources(build_deployment(service, CONFIG)) == {
        "requests": {"cpu": 2, "memory": "256Mi"}
    }


def test_each_pod_of_a_multi_node_replica_carries_its_share() -> None:
    resources = {"gpus": 4, "requests": {"memory": "100Gi"}, "limits": {"memory": "120Gi"}}
    service = isvc(
        engine={"kvOffloadingSizeGiB": 64},
        resources=resources,
        parallelism={"tensor": 4, "nodes": 2},
    )
    lws = build_leader_worker_set(service, CONFIG)["spec"]["leaderWorkerTemplate"]
    for template in (lws["leaderTemplate"], lws["workerTemplate"]):
        (container,) = template["spec"]["containers"]
        assert container["resources"]["requests"]["memory"] == "132Gi"  # 64 GiB over 2 pods
        assert container["resources"]["limits"]["memory"] == "152Gi"
    assert _host_tier(service) == HostTierObservation(64, "32Gi", None, None)


def test_status_shows_the_tier_and_warns_on_a_limit_below_it() -> None:
    small = {"gpus": 0, "requests": {"memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    service = routed(engine={"kvOffloadingSizeGiB": 8}, resources=small)
    tier = _host_tier(service)
    assert tier is not None and tier.picker_capacity_label == PREFIX_BLOCKS_LABEL
    warning = (
        "resources.limits.memory 4Gi is below the host tier's 8Gi per pod: the operator adds the "
        "tier on top of spec.resources (the pod's limit is 12Gi); if the limit was meant for the "
        "whole pod, lower engine.kvOffloadingSizeGiB"
    )
    assert tier.warning == warning
    status = build_status(
        Observation(1, "http://x", "s", False, None, None, [], host_tier=tier), {}, "T0"
    )
    assert status["hostTier"] == {
        "sizeGiB": 8,
        "memoryPerPod": "8Gi",
        "pickerCapacityLabel": PREFIX_BLOCKS_LABEL,
        "warning": warning,
    }
    # The Warning Event: once, when the warning appears (not again while it stays).
    assert Transition(WARNING, "HostTierMemory", warning) in transitions({}, status)
    assert [t for t in transitions(status, status) if t.reason == "HostTierMemory"] == []
    # No tier: no hostTier in the status at all; a large enough limit: no warning.
    assert _host_tier(isvc()) is None
    roomy = {"gpus": 0, "limits": {"memory": "8Gi"}}
    assert _host_tier(isvc(engine={"kvOffloadingSizeGiB": 8}, resources=roomy)) == (
        HostTierObservation(8, "8Gi", None, None)
    )


def test_the_picker_sizes_its_prefix_index_by_device_plus_host_blocks() -> None:
    def extractor(service: Any) -> dict[str, Any]:
        config = yaml.safe_load(build_config_map(service)["data"]["config.yaml"])
        (plugin,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
        parameters: dict[str, Any] = plugin["parameters"]
        return parameters

    # GIE's built-in vllm mapping, whole, with the block-count label moved to Quire's.
    assert extractor(routed(engine={"kvOffloadingSizeGiB": 4}))["engineConfigs"] == [
        {
            "name": "vllm",
            "queuedRequestsSpec": "vllm:num_requests_waiting",
            "runningRequestsSpec": "vllm:num_requests_running",
            "kvUsageSpec": "vllm:kv_cache_usage_perc",
            "loraSpec": "vllm:lora_requests_info",
            "cacheInfoSpec": "vllm:cache_config_info",
            "cacheNumBlocksLabelName": "num_prefix_blocks",
        }
    ]
    assert "engineConfigs" not in extractor(routed())  # without a tier: GIE's defaults
