"""Routing through an InferencePool (spec.routing) against the real control plane.

Real ``quire-operator`` processes against the real API server, controller manager and kwok nodes,
with the InferencePool CRD of the chart (the Go module's file). The expected objects are the pure
builders' output for the object as the API server stored it, so these tests prove that what the
builders say is what the cluster gets. kwok plays every kubelet, so the Endpoint Picker's pod
turns Ready without the picker running; the picker itself, with a Gateway, is exercised by
test_routing_stack.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from quire_operator.builders.endpoint_picker import EPP_APP, routing_children
from quire_operator.config import OperatorConfig
from quire_operator.kinds import Kind
from quire_operator.meta import ChildKey
from quire_operator.spec.parsing import parse
from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.api import (
    MERGE,
    NAME,
    assert_applied,
    condition,
    create_isvc,
    events,
    get_isvc,
    patch_spec,
    ready,
    service,
    wait_condition,
)
from tests.operator_tests.gie import (
    install_pool_crd,
    pool_crd_removed,
    read_child,
    routing_objects,
)
from tests.operator_tests.helpers import load_example
from tests.operator_tests.operator_process import GarbageCollectorProbe, Operators

pytestmark = pytest.mark.cluster

PICKER = f"{NAME}-epp"
POOL_KEY = ChildKey(Kind.INFERENCE_POOL, NAME)
CONFIG_KEY = ChildKey(Kind.CONFIG_MAP, PICKER)


@pytest.fixture(scope="module", autouse=True)
def pool_crd(cluster: ClusterHandle) -> None:
    """The InferencePool CRD, installed before any operator of this module starts (an operator
    watches pools only when their CRD is served at its start)."""
    install_pool_crd(cluster)


def routed_example(**routing: Any) -> dict[str, Any]:
    body = load_example()
    body["spec"]["routing"] = {"mode": "InferencePool", **routing}
    return body


def routing_ready(cluster: ClusterHandle, namespace: str, generation: int = 1) -> Any:
    return wait_for(
        f"RoutingReady with generation {generation}",
        lambda: get_isvc(cluster, namespace),
        lambda obj: (
            obj.get("status", {}).get("observedGeneration") == generation
            and condition(obj, "RoutingReady").get("status") == "True"
        ),
        timeout_s=60,
    )


def start_routed(cluster: ClusterHandle, namespace: str, operators: Operators) -> Any:
    """An operator, and the example with routing on, RoutingReady."""
    operators.start()
    create_isvc(cluster, namespace, routed_example())
    return routing_ready(cluster, namespace)


def assert_routing_applied(cluster: ClusterHandle, namespace: str, isvc: Any) -> None:
    """Every routing object is in the cluster as built, controlled by the InferenceService."""
    parsed = parse(isvc)
    live = routing_objects(cluster, parsed)
    for key, wanted in routing_children(parsed, OperatorConfig()):
        assert wanted is not None and live[key] is not None, key
        assert_applied(live[key], wanted, str(key))
        (owner,) = live[key]["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["controller"]) == (isvc["metadata"]["uid"], True), key


def test_routing_on_makes_the_pool_and_its_picker(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    isvc = start_routed(cluster, namespace, operators)
    ready(cluster, namespace)
    assert_routing_applied(cluster, namespace, isvc)

    # The pool selects exactly the engine pods, and the picker's pod is not one of them.
    pool = read_child(cluster, namespace, POOL_KEY)
    selector = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())

    def pods_of(label_selector: str) -> list[Any]:
        listed = cluster.core.list_namespaced_pod(namespace, label_selector=label_selector)
        pods: list[Any] = cluster.json(listed)["items"]
        return pods

    pods = pods_of(selector)
    engine = pods_of(meta.selector_string(NAME))
    names = sorted(p["metadata"]["name"] for p in pods)
    assert names == sorted(p["metadata"]["name"] for p in engine)
    assert len(pods) == 1
    (picker,) = pods_of(meta.selector_string(NAME, EPP_APP))
    assert picker["metadata"]["name"].startswith(f"{PICKER}-")
    assert picker["metadata"]["name"] not in {p["metadata"]["name"] for p in pods}
    assert pods[0]["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"

    status = isvc["status"]
    assert status["routing"] == {"inferencePool": NAME, "endpointPicker": PICKER, "parents": []}
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Ready", "True", "ReplicasReady"),
        ("Progressing", "False", "RolloutComplete"),
        ("Degraded", "False", "AsExpected"),
        ("RoutingReady", "True", "EndpointPickerReady"),
    ]
    assert ("Normal", "RoutingReady") in events(cluster, namespace)

    # kubectl get qis -o wide shows the routing mode.
    table = cluster.kubectl("get", "qis", "-n", namespace, "-o", "wide")
    assert table.returncode == 0, table.stderr
    header, row = (line.split() for line in table.stdout.splitlines())
    assert header[-1] == "ROUTING" and row[-1] == "InferencePool"


def test_weights_and_failure_mode_changes_are_followed(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    start_routed(cluster, namespace, operators)
    before = read_child(cluster, namespace, ChildKey(Kind.DEPLOYMENT, PICKER))

    weights = {"queue": 1, "kvCacheUtilization": 0, "prefixCache": 5, "loraAffinity": 4}
    patch_spec(
        cluster, namespace, {"routing": {"scorerWeights": weights, "failureMode": "FailOpen"}}
    )
    isvc = routing_ready(cluster, namespace, generation=2)
    assert_routing_applied(cluster, namespace, isvc)
    config = yaml.safe_load(read_child(cluster, namespace, CONFIG_KEY)["data"]["config.yaml"])
    (profile,) = config["schedulingProfiles"]
    assert profile["plugins"] == [  # no spec.lora: the LoRA-affinity scorer stays out
        {"pluginRef": "queue-scorer", "weight": 1},
        {"pluginRef": "prefix-cache-scorer", "weight": 5},
        {"pluginRef": "max-score-picker"},
    ]
    pool = read_child(cluster, namespace, POOL_KEY)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    # The picker reads its config at start: its pod template moved, so it restarts with it.
    after = read_child(cluster, namespace, ChildKey(Kind.DEPLOYMENT, PICKER))
    annotation = "quire.dev/endpoint-picker-config"
    old = before["spec"]["template"]["metadata"]["annotations"][annotation]
    assert after["spec"]["template"]["metadata"]["annotations"][annotation] != old

    # Someone edits the ConfigMap: not watched, it is restored by the next reconcile (here the
    # one a spec change causes).
    cluster.core.patch_namespaced_config_map(
        PICKER, namespace, {"data": {"config.yaml": "edited"}}, field_manager="someone"
    )
    patch_spec(cluster, namespace, {"routing": {"scorerWeights": {"queue": 3}}})
    routing_ready(cluster, namespace, generation=3)
    edited = read_child(cluster, namespace, CONFIG_KEY)["data"]["config.yaml"]
    assert yaml.safe_load(edited)["schedulingProfiles"][0]["plugins"][0] == {
        "pluginRef": "queue-scorer",
        "weight": 3,
    }


def test_routing_off_removes_everything_it_made(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    isvc = start_routed(cluster, namespace, operators)
    parsed = parse(isvc)

    patch_spec(cluster, namespace, {"routing": {"mode": "Service"}})
    wait_for(
        "every routing object deleted",
        lambda: routing_objects(cluster, parsed),
        lambda live: all(obj is None for obj in live.values()),
        timeout_s=30,
    )
    isvc = ready(cluster, namespace, generation=2)
    assert "routing" not in isvc["status"]
    assert [c["type"] for c in isvc["status"]["conditions"]] == ["Ready", "Progressing", "Degraded"]
    assert service(cluster, namespace) is not None  # the engine's own Service stays
    # Turning routing off on purpose is no loss: no RoutingNotReady Warning.
    assert ("Warning", "RoutingNotReady") not in events(cluster, namespace)

    # And on again: everything comes back.
    patch_spec(cluster, namespace, {"routing": {"mode": "InferencePool"}})
    assert_routing_applied(cluster, namespace, routing_ready(cluster, namespace, generation=3))


def test_a_foreign_object_of_a_picker_name_is_not_adopted(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    # Someone's ConfigMap already has the picker's name, labelled like the operator's own.
    labels = {meta.MANAGED_BY_LABEL: meta.FIELD_MANAGER, meta.INSTANCE_LABEL: NAME}
    foreign = {"metadata": {"name": PICKER, "labels": labels}, "data": {"config.yaml": "theirs"}}
    before = cluster.json(cluster.core.create_namespaced_config_map(namespace, foreign))  # type: ignore[arg-type]  # dict body: the client validates it
    operators.start()
    create_isvc(cluster, namespace, routed_example())
    isvc = wait_condition(cluster, namespace, "Degraded", reason="NotOwned")
    message = condition(isvc, "Degraded")["message"]
    assert message.startswith(
        f'ConfigMap "{PICKER}" already exists and is not controlled by this InferenceService'
    ), message
    assert condition(isvc, "RoutingReady")["reason"] == "NotOwned"
    after = read_child(cluster, namespace, CONFIG_KEY)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert "ownerReferences" not in after["metadata"]
    # Nothing of the routing (nor anything else) was applied meanwhile.
    assert read_child(cluster, namespace, POOL_KEY) is None
    assert read_child(cluster, namespace, ChildKey(Kind.DEPLOYMENT, PICKER)) is None

    cluster.core.delete_namespaced_config_map(PICKER, namespace)
    isvc = routing_ready(cluster, namespace)
    assert condition(isvc, "Degraded")["reason"] == "AsExpected"
    assert_routing_applied(cluster, namespace, isvc)


def test_gateway_reports_on_the_pool_reach_the_status(
    cluster: ClusterHandle, namespace: str, operators: Operators
) -> None:
    start_routed(cluster, namespace, operators)

    # What a Gateway implementation writes into the pool's status (its own parents entry).
    def report(accepted: str, message: str) -> None:
        parent = {
            "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                          "namespace": namespace, "name": "inference-gateway"},
            "controllerName": "example.com/gateway-controller",
            "conditions": [
                {"type": "Accepted", "status": accepted, "observedGeneration": 1,
                 "reason": "Accepted" if accepted == "True" else "NotSupportedByParent",
                 "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
        }  # fmt: skip
        cluster.custom.patch_namespaced_custom_object_status(
            "inference.networking.k8s.io", "v1", namespace, "inferencepools", NAME,
            {"status": {"parents": [parent]}}, _content_type=MERGE,
        )  # fmt: skip

    report("True", "")
    isvc = wait_for(
        "status.routing.parents from the pool",
        lambda: get_isvc(cluster, namespace),
        lambda obj: obj["status"].get("routing", {}).get("parents"),
        timeout_s=15,  # the operator watches pools: no resync needed
    )
    (parent,) = isvc["status"]["routing"]["parents"]
    assert parent["parentRef"]["name"] == "inference-gateway"
    assert parent["conditions"] == [
        {"type": "Accepted", "status": "True", "reason": "Accepted", "message": ""}
    ]
    assert condition(isvc, "RoutingReady")["message"] == (
        f"endpoint picker ready, InferencePool {NAME}: reported by Gateway "
        f"{namespace}/inference-gateway"
    )

    report("False", "ext_proc is not supported here")
    isvc = wait_condition(cluster, namespace, "RoutingReady", status="False", timeout_s=15)
    assert condition(isvc, "RoutingReady")["reason"] == "NotSupportedByParent"
    assert ("Warning", "RoutingNotReady") in events(cluster, namespace)


@pytest.mark.parametrize(
    ("routing", "name", "message"),
    [
        ({"mode": "Gateway"}, "bad",
         'spec.routing.mode: Unsupported value: "Gateway": supported values: "Service", '
         '"InferencePool"'),
        ({"mode": "InferencePool", "failureMode": "FailSoft"}, "bad",
         'spec.routing.failureMode: Unsupported value: "FailSoft": supported values: '
         '"FailClose", "FailOpen"'),
        ({"scorerWeights": {"queue": 0, "kvCacheUtilization": 0, "prefixCache": 0,
                            "loraAffinity": 0}}, "bad",
         'spec.routing.scorerWeights: Invalid value: at least one scorer weight '
         "must be above 0"),
        ({"scorerWeights": {"prefixCache": 101}}, "bad",
         "spec.routing.scorerWeights.prefixCache: Invalid value: 101: "
         "spec.routing.scorerWeights.prefixCache in body should be less than or equal to 100"),
        ({"scorerWeights": {"loraAffinity": -1}}, "bad",
         "spec.routing.scorerWeights.loraAffinity: Invalid value: -1: "
         "spec.routing.scorerWeights.loraAffinity in body should be greater than or equal to 0"),
        ({"endpointPicker": {"resources": {"requests": {"cpu": "lots"}}}}, "bad",
         'spec.routing.endpointPicker.resources.requests.cpu: Invalid value: "lots": '
         "must be a quantity"),
        ({"mode": "InferencePool"}, "n" * 60,
         "metadata.name must be at most 59 characters with spec.routing.mode InferencePool"),
    ],
    ids=["mode", "failure-mode", "all-weights-zero", "weight-101", "lora-weight-negative",
         "picker-cpu", "long-name"],
)  # fmt: skip
def test_bad_routing_is_rejected_by_the_api_server(
    cluster: ClusterHandle,
    crds: GarbageCollectorProbe,
    namespace: str,
    routing: dict[str, Any],
    name: str,
    message: str,
) -> None:
    body = {**load_example(), "metadata": {"name": name}}
    body["spec"] = {**body["spec"], "routing": routing}
    with pytest.raises(ApiException) as rejected:
        create_isvc(cluster, namespace, body)
    assert rejected.value.status == 422
    text = json.loads(str(rejected.value.body))["message"]
    assert text.startswith(f'InferenceService.quire.dev "{name}" is invalid: '), text
    assert message in text, text


@pytest.fixture
def without_pool_crd(cluster: ClusterHandle) -> Iterator[None]:
    with pool_crd_removed(cluster):
        yield


def test_routing_without_the_crd_degrades_until_it_is_installed(
    cluster: ClusterHandle, namespace: str, operators: Operators, without_pool_crd: None
) -> None:
    operators.start()
    create_isvc(cluster, namespace, routed_example())
    isvc = wait_condition(cluster, namespace, "Degraded", reason="InferencePoolCRDMissing")
    assert condition(isvc, "RoutingReady")["status"] == "False"
    assert condition(isvc, "RoutingReady")["reason"] == "InferencePoolCRDMissing"
    assert "install the CRD" in condition(isvc, "Degraded")["message"]
    # The engine serves through its Service meanwhile; nothing of the routing was made.
    ready_engine = wait_condition(cluster, namespace, "Ready", status="True", timeout_s=60)
    assert read_child(cluster, namespace, ChildKey(Kind.DEPLOYMENT, PICKER)) is None
    assert ("Warning", "InferencePoolCRDMissing") in events(cluster, namespace)

    # The CRD arrives: the retries converge without a restart or a spec change.
    install_pool_crd(cluster)
    # At most one retry interval later: the requeue's backoff grows to 60 s.
    isvc = wait_condition(cluster, namespace, "RoutingReady", status="True", timeout_s=90)
    assert condition(isvc, "Degraded")["reason"] == "AsExpected"
    assert isvc["metadata"]["generation"] == ready_engine["metadata"]["generation"]
    assert_routing_applied(cluster, namespace, isvc)


def test_deleting_the_inference_service_garbage_collects_the_routing(
    cluster: ClusterHandle, namespace: str, operators: Operators, crds: GarbageCollectorProbe
) -> None:
    operator = operators.start()
    create_isvc(cluster, namespace, routed_example())
    isvc = routing_ready(cluster, namespace)
    crds.wait()
    parsed = parse(isvc)
    operator.stop()  # deletion needs only owner references and the garbage collector
    cluster.custom.delete_namespaced_custom_object(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, NAME
    )
    wait_for(
        "every routing object garbage-collected",
        lambda: routing_objects(cluster, parsed),
        lambda live: all(obj is None for obj in live.values()),
        timeout_s=60,
    )
