"""The Gateway API Inference Extension in the test cluster: its InferencePool CRD (the chart's
byte copy of the Go module's file), the Gateway API CRDs its examples need, and reads of the
routing objects the operator makes.

CRDs are cluster-wide while every test has a namespace of its own, so whoever installs one leaves
it installed (other tests of the session may rely on it); a test that removes one to see the
operator without it installs it again before it ends (``pool_crd_removed``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator.builders.endpoint_picker import routing_children
from quire_operator.config import OperatorConfig
from quire_operator.meta import ChildKey
from quire_operator.spec.view import InferenceService
from tests.cluster.client import ClusterHandle, wait_for
from tests.operator_tests.helpers import ROOT

POOL_CRD = "inferencepools.inference.networking.k8s.io"
POOL_CRD_FILE = ROOT / "charts" / "quire" / "files" / f"{POOL_CRD}.yaml"
# The Gateway API release GIE v1.5.0's conformance tests run against (its conformance/go.mod).
GATEWAY_API = ("sigs.k8s.io/gateway-api", "v1.5.1")
GATEWAY_API_CRDS = ("gateways", "httproutes")


def go_module_dir(module: str, version: str, work: Path) -> Path:
    """``go mod download`` of ``module@version`` (through the Go module proxy, checked against
    the checksum database); skips locally and fails under CI when there is no Go."""
    try:
        proc = subprocess.run(
            ["go", "mod", "download", "-json", f"{module}@{version}"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except FileNotFoundError:
        reason = f"no `go` on PATH to fetch {module}@{version}"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(reason)
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stderr
    return Path(json.loads(proc.stdout)["Dir"])


def apply_crds(cluster: ClusterHandle, files: list[Path], names: list[str]) -> None:
    """Server-side apply (large CRDs exceed client-side apply's annotation limit), then wait
    until each is Established."""
    applied = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", *(f"--filename={f}" for f in files)
    )
    assert applied.returncode == 0, applied.stderr
    waited = cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *(f"crd/{n}" for n in names)
    )
    assert waited.returncode == 0, waited.stderr


def install_pool_crd(cluster: ClusterHandle) -> None:
    apply_crds(cluster, [POOL_CRD_FILE], [POOL_CRD])


def remove_pool_crd(cluster: ClusterHandle) -> None:
    """Delete the CRD and wait until the API server no longer serves it."""
    cluster.kubectl("delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true")
    wait_for(
        f"{POOL_CRD} gone from discovery",
        lambda: pool_crd_served(cluster),
        lambda served: not served,
        timeout_s=60,
    )


def pool_crd_served(cluster: ClusterHandle) -> bool:
    try:
        found = cluster.custom.get_api_resources("inference.networking.k8s.io", "v1")
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return any(r.name == "inferencepools" for r in found.resources)


@contextlib.contextmanager
def pool_crd_removed(cluster: ClusterHandle) -> Iterator[None]:
    """The cluster without the InferencePool CRD for the block, with it again afterwards."""
    remove_pool_crd(cluster)
    try:
        yield
    finally:
        install_pool_crd(cluster)


def install_gateway_api_crds(cluster: ClusterHandle, work: Path) -> None:
    """The Gateway API's Gateway and HTTPRoute CRDs (standard channel) from its Go module."""
    crds = go_module_dir(*GATEWAY_API, work) / "config" / "crd" / "standard"
    files = [crds / f"gateway.networking.k8s.io_{plural}.yaml" for plural in GATEWAY_API_CRDS]
    apply_crds(cluster, files, [f"{p}.gateway.networking.k8s.io" for p in GATEWAY_API_CRDS])


def read_child(cluster: ClusterHandle, namespace: str, key: ChildKey) -> Any:
    """One routing object as API JSON, or None when it does not exist."""
    core, apps = cluster.core, cluster.apps
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    reads = {
        "ServiceAccount": core.read_namespaced_service_account,
        "ConfigMap": core.read_namespaced_config_map,
        "Service": core.read_namespaced_service,
        "Deployment": apps.read_namespaced_deployment,
        "Role": rbac.read_namespaced_role,
        "RoleBinding": rbac.read_namespaced_role_binding,
        "InferencePool": lambda name, ns: cluster.custom.get_namespaced_custom_object(
            "inference.networking.k8s.io", "v1", ns, "inferencepools", name
        ),
    }
    try:
        return cluster.json(reads[key.kind](key.name, namespace))
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def routing_objects(cluster: ClusterHandle, isvc: InferenceService) -> dict[ChildKey, Any]:
    """Every routing object of ``isvc`` as it is in the cluster (None where missing)."""
    keys = [key for key, _ in routing_children(isvc, OperatorConfig())]
    return {key: read_child(cluster, isvc.ref.namespace, key) for key in keys}
