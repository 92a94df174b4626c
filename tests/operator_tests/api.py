"""API helpers for the operator's cluster tests: manifests and patches as plain dicts (as they
read in YAML), objects read back as API JSON, and bounded waits on InferenceService status."""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from quire_operator import meta
from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.helpers import load_example

NAME = "tiny"  # the example's name
MERGE = "application/merge-patch+json"


def get_isvc(cluster: ClusterHandle, namespace: str, name: str = NAME) -> Any:
    return cluster.custom.get_namespaced_custom_object(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, name
    )


def create_isvc(cluster: ClusterHandle, namespace: str, body: dict[str, Any]) -> Any:
    return cluster.custom.create_namespaced_custom_object(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, body
    )


def patch_spec(
    cluster: ClusterHandle, namespace: str, spec: dict[str, Any], name: str = NAME
) -> Any:
    return cluster.custom.patch_namespaced_custom_object(
        meta.GROUP, meta.VERSION, namespace, meta.PLURAL, name, {"spec": spec}, _content_type=MERGE
    )


def condition(obj: Any, kind: str) -> Any:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def read_json(cluster: ClusterHandle, read: Any, namespace: str, name: str = NAME) -> Any:
    """``read(name, namespace)`` as JSON, or None when it does not exist."""
    try:
        return cluster.json(read(name, namespace))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def deployment(cluster: ClusterHandle, namespace: str, name: str = NAME) -> Any:
    return read_json(cluster, cluster.apps.read_namespaced_deployment, namespace, name)


def hpa(cluster: ClusterHandle, namespace: str, name: str = NAME) -> Any:
    read = cluster.autoscaling.read_namespaced_horizontal_pod_autoscaler
    return read_json(cluster, read, namespace, name)


def pdb(cluster: ClusterHandle, namespace: str, name: str = NAME) -> Any:
    from kubernetes import client

    read = client.PolicyV1Api(cluster.api).read_namespaced_pod_disruption_budget
    return read_json(cluster, read, namespace, name)


def service(cluster: ClusterHandle, namespace: str, name: str = NAME) -> Any:
    return read_json(cluster, cluster.core.read_namespaced_service, namespace, name)


def engine_args(deployment: Any) -> list[str]:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def flag(deployment: Any, name: str) -> str:
    args = engine_args(deployment)
    return args[args.index(name) + 1]


def operator_apply_fields(obj: Any) -> Any:
    """The fields the operator's server-side apply owns (its managedFields entry)."""
    (entry,) = [
        m
        for m in obj["metadata"]["managedFields"]
        if m["manager"] == meta.FIELD_MANAGER and m["operation"] == "Apply"
    ]
    return entry["fieldsV1"]


def assert_applied(live: Any, wanted: Any, path: str = "") -> None:
    """Every field of the applied configuration ``wanted`` is in ``live`` with that value
    (the API server adds defaults and status around them)."""
    if isinstance(wanted, dict):
        assert isinstance(live, dict), f"{path}: {live!r} is not an object"
        for key, value in wanted.items():
            assert key in live, f"{path}.{key} missing from {sorted(live)}"
            assert_applied(live[key], value, f"{path}.{key}")
    elif isinstance(wanted, list):
        assert isinstance(live, list) and len(live) == len(wanted), f"{path}: {live!r}"
        for index, (got, want) in enumerate(zip(live, wanted, strict=True)):
            assert_applied(got, want, f"{path}[{index}]")
    else:
        assert live == wanted, f"{path}: {live!r} != {wanted!r}"


def ready(cluster: ClusterHandle, namespace: str, generation: int = 1, name: str = NAME) -> Any:
    """Wait until the status reports ``generation`` reconciled, rolled out and Ready."""
    return wait_for(
        f"{name} Ready with generation {generation} rolled out",
        lambda: get_isvc(cluster, namespace, name),
        lambda obj: (
            obj.get("status", {}).get("observedGeneration") == generation
            and condition(obj, "Ready").get("status") == "True"
            and condition(obj, "Progressing").get("status") == "False"
        ),
        timeout_s=60,
    )


def wait_condition(
    cluster: ClusterHandle, namespace: str, kind: str, timeout_s: float = 30, **wanted: str
) -> Any:
    """Wait until the InferenceService's condition ``kind`` has the ``wanted`` fields (e.g.
    ``reason="NotOwned"``); returns the object."""
    described = ", ".join(f"{key}={value}" for key, value in wanted.items())
    return wait_for(
        f"{kind} with {described}",
        lambda: get_isvc(cluster, namespace),
        lambda obj: all(condition(obj, kind).get(key) == v for key, v in wanted.items()),
        timeout_s=timeout_s,
    )


def create_example(cluster: ClusterHandle, namespace: str) -> Any:
    create_isvc(cluster, namespace, load_example())
    return ready(cluster, namespace)


def events(cluster: ClusterHandle, namespace: str, name: str = NAME) -> list[tuple[str, str]]:
    """(type, reason) of the operator's Events on the InferenceService, sorted (timestamps have
    a one-second grain, so order within a second is not recorded)."""
    found = cluster.json(
        cluster.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.kind={meta.KIND},involvedObject.name={name}"
        )
    )["items"]
    return sorted(
        (e["type"], e["reason"]) for e in found if e["source"]["component"] == meta.FIELD_MANAGER
    )
