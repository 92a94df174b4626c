"""What the kubelet stand-in runs for a pod (tests/cluster/pod_launch.py), without a cluster: the
API is a dict of objects behind ``ControlPlane.request``'s signature (the unit seam), and the
pods are shaped like the operator's engine pods and GIE's chart's EPP pods."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.gateway import FailureMode, GatewayConfig, bootstrap
from tests.cluster.pod_launch import LaunchError, Workload, plan, workload_of

NAMESPACE = "ns"
OBJECTS: dict[str, Any] = {
    f"/api/v1/namespaces/{NAMESPACE}/configmaps/epp-config": {
        "kind": "ConfigMap",
        "data": {"default-plugins.yaml": "kind: EndpointPickerConfig\n"},
    },
    f"/api/v1/namespaces/{NAMESPACE}/secrets/key": {
        "kind": "Secret",
        "data": {"api-key": base64.b64encode(b"s3cret").decode()},
    },
}


class FakeApi:
    """GETs answer from OBJECTS; a TokenRequest answers a fixed token; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def __call__(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.calls.append((method, path, body))
        if method == "POST" and path.endswith("/token"):
            return 201, {"status": {"token": "pod-token"}}
        if path in OBJECTS:
            return 200, OBJECTS[path]
        return 404, {"reason": "NotFound"}


def pod(container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": NAMESPACE, "uid": "u-1"},
        "spec": {"containers": [container], "nodeName": "kwok-cpu-0", **spec},
        "status": {"phase": "Running", "podIP": "127.9.1.4"},
    }


def launch(manifest: dict[str, Any], tmp_path: Path, api: FakeApi | None = None) -> Any:
    return plan(
        manifest,
        api or FakeApi(),
        files_dir=tmp_path,
        epp_binary=Path("/cache/epp"),
        server="https://127.0.0.1:6443",
        ca_data="Q0E=",
    )


ENGINE = {
    "name": "engine",
    "image": "quire.invalid/engine:1",
    "command": ["quire-engine"],
    "args": ["serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000"],
    "ports": [{"containerPort": 8000}],
    "env": [
        {"name": "QUIRE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "key", "key": "api-key"}}}
    ],
}
EPP = {
    "name": "epp",
    "image": "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0",
    "args": [
        "--pool-name",
        "tiny",
        "--pool-namespace",
        "$(NAMESPACE)",
        "--config-file",
        "/config/default-plugins.yaml",
        "--grpc-port=9002",
    ],
    "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    "volumeMounts": [{"name": "config", "mountPath": "/config"}],
}


def test_an_engine_pod_serves_on_its_pod_ip_and_container_port(tmp_path: Path) -> None:
    got = launch(pod(ENGINE), tmp_path)

    assert got.workload is Workload.ENGINE
    assert got.argv[:3] == [sys.executable, "-m", "quire_engine.cli"]
    args = got.argv[3:]
    assert args[args.index("--host") + 1] == "127.9.1.4"
    assert args[args.index("--port") + 1] == "8000"
    assert (got.ip, got.port, got.ports) == ("127.9.1.4", 8000, {8000: 8000})
    assert got.env["QUIRE_API_KEY"] == "s3cret"  # from the Secret, as a kubelet would


def test_an_epp_pod_gets_free_ports_its_config_file_and_its_service_account(
    tmp_path: Path,
) -> None:
    api = FakeApi()
    got = launch(
        pod(EPP, volumes=[{"name": "config", "configMap": {"name": "epp-config"}}]), tmp_path, api
    )

    assert got.workload is Workload.EPP
    assert got.argv[0] == "/cache/epp"
    args = got.argv[1:]
    assert args[args.index("--pool-namespace") + 1] == NAMESPACE  # $(NAMESPACE) expanded
    config = Path(args[args.index("--config-file") + 1])
    assert config.read_text() == "kind: EndpointPickerConfig\n"
    assert tmp_path in config.parents
    grpc = int(next(a.split("=", 1)[1] for a in args if a.startswith("--grpc-port=")))
    assert got.port == grpc == got.ports[9002]
    assert set(got.ports) == {9002, 9003, 9090}  # every listener moved off its default
    assert len(set(got.ports.values())) == 3
    kubeconfig = json.loads(Path(got.env["KUBECONFIG"]).read_text())
    assert kubeconfig["users"][0] == {"name": "default", "user": {"token": "pod-token"}}
    ((_, path, body),) = [call for call in api.calls if call[0] == "POST"]
    assert path == f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default/token"
    assert body["spec"]["boundObjectRef"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "p",
        "uid": "u-1",
    }


def test_an_epp_pod_without_a_token_gets_no_credentials(tmp_path: Path) -> None:
    manifest = pod(EPP, automountServiceAccountToken=False, volumes=[
        {"name": "config", "configMap": {"name": "epp-config"}},
    ])  # fmt: skip
    got = launch(manifest, tmp_path)
    assert json.loads(Path(got.env["KUBECONFIG"]).read_text())["users"][0]["user"] == {}


def test_pods_that_cannot_run_here_say_why(tmp_path: Path) -> None:
    assert workload_of({"name": "x", "image": "nginx:1"}) is None
    assert workload_of({"name": "e", "image": "localhost:5000/gie/epp@sha256:00"}) is Workload.EPP
    assert launch(pod({"name": "x", "image": "nginx:1"}), tmp_path) is None
    missing_secret = {**ENGINE, "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}},
    ]}  # fmt: skip
    with pytest.raises(LaunchError, match="secret absent/k"):
        launch(pod(missing_secret), tmp_path)
    no_ip = pod(ENGINE)
    del no_ip["status"]["podIP"]
    with pytest.raises(LaunchError, match=r"no status\.podIP"):
        launch(no_ip, tmp_path)


def test_fail_open_needs_a_fallback_and_fail_close_has_none() -> None:
    with pytest.raises(ValueError, match="fallback"):
        GatewayConfig(epp="127.0.0.1:9002", failure_mode=FailureMode.FAIL_OPEN)
    with pytest.raises(ValueError, match="fallback"):
        GatewayConfig(epp="127.0.0.1:9002", fallback="127.9.1.4:8000")
    with pytest.raises(ValueError, match="host:port"):
        bootstrap(GatewayConfig(epp="nowhere"), 1, 2)
