"""Scale to zero (``autoscaling.minReplicas: 0``) against the real control plane: which
combinations the API server accepts, and that the operator applies the ScaledObject and the
Endpoint Picker's hold queue exactly as the builders say.

The control plane has KEDA's ScaledObject CRD (from KEDA's Go module) but no KEDA controller and
no Endpoint Picker process: holding requests from zero end to end is not proven here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from quire_operator.builders.autoscaling import build_scaled_object
from quire_operator.builders.endpoint_picker import routing_children
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.meta import ChildKey
from quire_operator.spec.parsing import parse
from tests.cluster.build import KEDA_VERSION
from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.api import (
    NAME,
    assert_applied,
    condition,
    create_isvc,
    events,
    get_isvc,
    ready,
)
from tests.operator_tests.gie import apply_crds, go_module_dir, install_pool_crd, read_child
from tests.operator_tests.helpers import load_example
from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators

pytestmark = pytest.mark.cluster

PROMETHEUS = "http://prometheus.monitoring:9090"
SCALED_OBJECT_CRD = "scaledobjects.keda.sh"


@pytest.fixture(scope="module")
def keda_crd(cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """KEDA's ScaledObject CRD for this module's tests, and the InferencePool CRD (both before
    any operator starts); the ScaledObject CRD is removed afterwards (other modules test a
    cluster without KEDA)."""
    install_pool_crd(cluster)
    module = go_module_dir(
        "github.com/kedacore/keda/v2", KEDA_VERSION, tmp_path_factory.mktemp("gomod")
    )
    crd = module / "config" / "crd" / "bases" / "keda.sh_scaledobjects.yaml"
    apply_crds(cluster, [crd], [SCALED_OBJECT_CRD])
    try:
        yield
    finally:
        cluster.kubectl("delete", "crd", SCALED_OBJECT_CRD, "--ignore-not-found", "--wait=true")


def zero_body(name: str = NAME, **autoscaling: Any) -> dict[str, Any]:
    body = load_example()
    body["metadata"] = {"name": name}
    body["spec"]["autoscaling"].update(backend="keda", minReplicas=0, **autoscaling)
    body["spec"]["routing"] = {"mode": "InferencePool"}
    return body


def rejected_message(cluster: ClusterHandle, namespace: str, body: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as rejected:
        create_isvc(cluster, namespace, body)
    assert rejected.value.status == 422
    text: str = json.loads(str(rejected.value.body))["message"]
    assert text.startswith(f'InferenceService.quire.dev "{body["metadata"]["name"]}" is invalid: ')
    return text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b["spec"]["autoscaling"].update(backend="hpa"),
         "minReplicas 0 (scale to zero) needs backend keda"),
        (lambda b: b["spec"].pop("routing"),
         "spec.autoscaling.minReplicas 0 needs spec.routing.mode InferencePool"),
        (lambda b: b["spec"]["autoscaling"].update(scaleToZero={"queueSize": 0}),
         "spec.autoscaling.scaleToZero.queueSize: Invalid value: 0"),
        (lambda b: b["spec"]["autoscaling"].update(scaleToZero={"holdTimeoutSeconds": 0}),
         "spec.autoscaling.scaleToZero.holdTimeoutSeconds: Invalid value: 0"),
        (lambda b: b["spec"]["autoscaling"].update(minReplicas=-1),
         "spec.autoscaling.minReplicas: Invalid value: -1"),
    ],
    ids=["hpa", "no-pool", "queue-0", "hold-0", "negative"],
)  # fmt: skip
def test_bad_scale_to_zero_is_rejected_by_the_api_server(
    cluster: ClusterHandle,
    crds: GarbageCollectorProbe,
    namespace: str,
    change: Any,
    message: str,
) -> None:
    body = zero_body("bad")
    change(body)
    text = rejected_message(cluster, namespace, body)
    assert message in text, text


def test_zero_on_keda_with_the_pool_is_accepted_with_the_hold_defaults(
    cluster: ClusterHandle, crds: GarbageCollectorProbe, namespace: str
) -> None:
    created = create_isvc(cluster, namespace, zero_body())
    assert created["spec"]["autoscaling"]["minReplicas"] == 0
    assert created["spec"]["autoscaling"]["scaleToZero"] == {
        "queueSize": 100,
        "holdTimeoutSeconds": 300,
    }
    # Autoscaling off: minReplicas 0 on keda needs no pool (nothing scales).
    off = zero_body("off", enabled=False)
    off["spec"].pop("routing")
    create_isvc(cluster, namespace, off)


def test_operator_applies_the_scaled_object_and_the_hold_queue_as_built(
    cluster: ClusterHandle, namespace: str, operators: Operators, keda_crd: None
) -> None:
    operators.start(f"--prometheus-address={PROMETHEUS}")
    body = zero_body(scaleToZero={"queueSize": 20, "holdTimeoutSeconds": 600})
    create_isvc(cluster, namespace, body)
    stored = wait_for(
        "observedGeneration 1",
        lambda: get_isvc(cluster, namespace),
        lambda obj: obj.get("status", {}).get("observedGeneration") == 1,
        timeout_s=60,
    )
    isvc = parse(stored)
    config = OperatorConfig(prometheus_address=PROMETHEUS)

    wanted = build_scaled_object(isvc, config)
    assert wanted is not None
    live = wait_for(
        "the ScaledObject",
        lambda: read_scaled_object(cluster, namespace),
        lambda obj: obj is not None,
        timeout_s=60,
    )
    assert_applied(live, wanted, "ScaledObject")
    assert live["spec"]["minReplicaCount"] == 0
    assert live["spec"]["triggers"][-1]["name"] == "held-requests"

    picker = dict(routing_children(isvc, config))
    for key in (ChildKey(Kind.CONFIG_MAP, f"{NAME}-epp"), ChildKey(Kind.DEPLOYMENT, f"{NAME}-epp")):
        found = wait_for(
            str(key),
            functools.partial(read_child, cluster, namespace, key),
            lambda obj: obj is not None,
            timeout_s=60,
        )
        assert_applied(found, picker[key], str(key))
    config_text = read_child(cluster, namespace, ChildKey(Kind.CONFIG_MAP, f"{NAME}-epp"))
    assert (
        "flowControl:\n  maxRequests: 20\n  defaultRequestTTL: 600s\n"
        in (config_text["data"]["config.yaml"])
    )


def test_scaling_to_and_from_zero_shows_in_the_status_and_events(
    cluster: ClusterHandle, namespace: str, operators: Operators, keda_crd: None
) -> None:
    """The Deployment's replicas are set by hand here, as KEDA's HPA would set them (no KEDA
    controller runs): the operator owns no spec.replicas with autoscaling on."""
    operators.start(f"--prometheus-address={PROMETHEUS}")
    create_isvc(cluster, namespace, zero_body())
    running = wait_for(
        "ScaledToZero False with 1 replica, RoutingReady",
        lambda: get_isvc(cluster, namespace),
        lambda obj: (
            zero_condition(obj) == ("False", "Scaled")
            and condition(obj, "RoutingReady").get("status") == "True"
        ),
        timeout_s=60,
    )
    # No KEDA controller writes the ScaledObject's status: its conditions are empty.
    assert running["status"]["autoscaler"] == {
        "kind": "ScaledObject",
        "name": NAME,
        "conditions": [],
    }

    # KEDA's verdicts, written as KEDA would: the watch brings them into status.autoscaler.
    verdicts = [
        {"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"},
        {"type": "Active", "status": "False", "reason": "ScalerNotActive", "message": "idle"},
    ]
    cluster.custom.patch_namespaced_custom_object_status(
        "keda.sh",
        "v1alpha1",
        namespace,
        "scaledobjects",
        NAME,
        {"status": {"conditions": verdicts}},
    )
    wait_for(
        "status.autoscaler with KEDA's conditions",
        lambda: get_isvc(cluster, namespace),
        lambda obj: obj["status"].get("autoscaler", {}).get("conditions") == verdicts,
        timeout_s=30,
    )
    ready(cluster, namespace)  # so that going to zero loses readiness
    for replicas, wanted in ((0, ("True", "NoReplicas")), (2, ("False", "Scaled"))):
        scaled = cluster.kubectl(
            "scale", "deployment", NAME, "-n", namespace, f"--replicas={replicas}"
        )
        assert scaled.returncode == 0, scaled.stderr

        def reached(obj: dict[str, Any], wanted: tuple[str, str] = wanted) -> bool:
            return zero_condition(obj) == wanted

        obj = wait_for(
            f"ScaledToZero {wanted}",
            lambda: get_isvc(cluster, namespace),
            reached,
            timeout_s=60,
        )
        assert obj["status"]["desiredReplicas"] == replicas
    wait_for(
        "the ScaledToZero and ScaledFromZero Events",
        lambda: events(cluster, namespace),
        lambda found: {("Normal", "ScaledToZero"), ("Normal", "ScaledFromZero")} <= set(found),
        timeout_s=30,
    )
    assert ("Warning", "NotReady") not in events(cluster, namespace)
    table = cluster.kubectl("get", "qis", "-n", namespace, "-o", "wide")
    assert table.returncode == 0, table.stderr
    header, row = (line.split() for line in table.stdout.splitlines())
    assert row[header.index("AUTOSCALER")] == "ScaledObject"
    assert row[header.index("ZERO")] == "False"


def zero_condition(obj: Any) -> tuple[str, str] | None:
    found = condition(obj, "ScaledToZero")
    return (found["status"], found["reason"]) if found else None


def read_scaled_object(cluster: ClusterHandle, namespace: str) -> Any:
    try:
        return cluster.custom.get_namespaced_custom_object(
            "keda.sh", "v1alpha1", namespace, "scaledobjects", NAME
        )
    except ApiException as err:
        if err.status == 404:
            return None
        raise
