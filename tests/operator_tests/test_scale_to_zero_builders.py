"""Scale to zero as pure builders: the ScaledObject wakes on the Endpoint Picker's held requests,
the picker's config holds them (GIE flow control) and its flags let them through; no cluster
(specs are defaulted from the CRD file as the API server would)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from quire_operator.builders.autoscaling import build_scaled_object
from quire_operator.builders.endpoint_picker import build_config_map, build_epp_deployment, epp_args
from quire_operator.spec.parsing import parse
from quire_operator.spec.view import InferenceService, ScaleToZero
from tests.operator_tests.helpers import inference_service, load_example
from tests.operator_tests.test_autoscaling_builders import CONFIG, PROMETHEUS, UID
from tests.operator_tests.test_routing_builders import DEFAULT_CONFIG

HELD = 'sum(inference_extension_flow_control_queue_size{namespace="ml",inference_pool="tiny"})'
ENGINE_TRIGGERS = ["kv-cache-usage", "queue-depth"]  # the example's targets


def zero(mode: str = "InferencePool", **autoscaling: Any) -> InferenceService:
    """The example (name tiny, namespace ml) on KEDA with minReplicas 0."""
    spec = load_example()["spec"]
    merged = {**spec["autoscaling"], "backend": "keda", "minReplicas": 0, **autoscaling}
    body = {**spec, "autoscaling": merged, "routing": {"mode": mode}}
    return parse(inference_service(body, name="tiny", uid=UID))


def one() -> InferenceService:
    return zero(minReplicas=1)


def test_scaled_object_scales_to_zero_and_wakes_on_held_requests() -> None:
    scaled = build_scaled_object(zero(), CONFIG)
    assert scaled is not None
    spec = scaled["spec"]
    assert (spec["minReplicaCount"], spec["cooldownPeriod"]) == (0, 300)
    assert [t["name"] for t in spec["triggers"]] == [*ENGINE_TRIGGERS, "held-requests"]
    assert spec["triggers"][-1] == {
        "type": "prometheus",
        "name": "held-requests",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": PROMETHEUS,
            "query": HELD,
            # The example's targetQueueDepth: held requests count like waiting ones.
            "threshold": "8",
            "activationThreshold": "0",
        },
    }


def test_idle_period_is_kedas_cooldown_and_threshold_defaults_without_a_queue_target() -> None:
    service = zero(keda={"cooldownPeriod": 900}, targetQueueDepth=None)
    scaled = build_scaled_object(service, CONFIG)
    assert scaled is not None
    assert scaled["spec"]["cooldownPeriod"] == 900
    assert scaled["spec"]["triggers"][-1]["metadata"]["threshold"] == "5"


def test_min_one_keeps_the_scaled_object_and_picker_as_they_were() -> None:
    scaled = build_scaled_object(one(), CONFIG)
    assert scaled is not None
    assert scaled["spec"]["minReplicaCount"] == 1
    assert [t["name"] for t in scaled["spec"]["triggers"]] == ENGINE_TRIGGERS
    assert build_config_map(one())["data"]["config.yaml"] == DEFAULT_CONFIG
    assert "--disable-endpoint-subset-filter" not in epp_args(one())


def test_picker_config_enables_flow_control_with_the_hold_settings() -> None:
    text = build_config_map(zero())["data"]["config.yaml"]
    assert text == DEFAULT_CONFIG + (
        "featureGates:\n- flowControl\n"
        "flowControl:\n  maxRequests: 100\n  defaultRequestTTL: 300s\n"
    )
    custom = zero(scaleToZero={"queueSize": 20, "holdTimeoutSeconds": 600})
    config = yaml.safe_load(build_config_map(custom)["data"]["config.yaml"])
    assert config["flowControl"] == {"maxRequests": 20, "defaultRequestTTL": "600s"}


def test_picker_flags_let_held_requests_through_and_metrics_be_scraped() -> None:
    assert epp_args(zero())[-2:] == [
        "--metrics-endpoint-auth=false",
        "--disable-endpoint-subset-filter",
    ]
    # A changed hold queue rolls the picker (it reads its config once at start).
    annotations = [
        build_epp_deployment(service, CONFIG)["spec"]["template"]["metadata"]["annotations"]
        for service in (zero(), one())
    ]
    assert annotations[0] != annotations[1]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"backend": "hpa"}, "needs backend keda"),
        ({"scaleToZero": {"queueSize": 0}}, "queueSize and holdTimeoutSeconds must be >= 1"),
    ],
)
def test_invariants_are_checked_without_the_crd(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        zero(**body)


def test_zero_without_the_pool_is_refused_without_the_crd() -> None:
    with pytest.raises(ValueError, match=r"needs routing\.mode InferencePool"):
        zero(mode="Service")


def test_hold_defaults_are_the_crds() -> None:
    assert zero().autoscaling.scale_to_zero == ScaleToZero(queue_size=100, hold_timeout_s=300)
