"""What the ``cluster`` pytest fixture hands to tests: kubeconfig, Python clients, CLI env.

Ownership: ``ClusterHandle`` owns one ``kubernetes.client.ApiClient`` (closed by the fixture at
session end); the control plane itself stays owned by the fixture. This module imports the
``kubernetes`` package, which is why it is separate from the stdlib-only launcher.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.waiting import wait_until

from .build import Binaries
from .launcher import ControlPlane
from .pod_launch import Api
from .pod_runner import ApiServer

T = TypeVar("T")


@dataclass
class ClusterHandle:
    """A ready cluster: ``kubeconfig`` path, ``api`` client and typed API groups."""

    control_plane: ControlPlane
    binaries: Binaries
    kubeconfig: Path
    api: client.ApiClient = field(init=False)

    def __post_init__(self) -> None:
        # A client of its own instead of kubernetes.config.load_kube_config(), which would
        # rewrite the library-wide default configuration behind other code's back.
        self.api = config.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    @property
    def autoscaling(self) -> client.AutoscalingV2Api:
        return client.AutoscalingV2Api(self.api)

    @property
    def apiextensions(self) -> client.ApiextensionsV1Api:
        return client.ApiextensionsV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def json(self, obj: object) -> Any:
        """A client model object as the API's JSON shape (camelCase keys, no None fields).

        Tests assert on this form: it reads like the YAML of the object and sidesteps the
        Optional attributes of the typed models.
        """
        return self.api.sanitize_for_serialization(obj)

    def env(self) -> dict[str, str]:
        """Environment for subprocesses: KUBECONFIG set, cached kubectl/helm first on PATH."""
        path = os.pathsep.join([*(str(d) for d in self.binaries.bin_dirs()), os.environ["PATH"]])
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": path}

    def kubectl(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the cached kubectl against this cluster (output captured, never raises)."""
        return self._run([str(self.binaries.kubectl), *args], timeout_s)

    def helm(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run the cached helm against this cluster (output captured, never raises)."""
        return self._run([str(self.binaries.helm), *args], timeout_s)

    def _run(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, env=self.env(), timeout=timeout_s, check=False
        )

    def close(self) -> None:
        self.api.close()


def wait_for(
    what: str,
    fetch: Callable[[], T],
    until: Callable[[T], bool],
    *,
    timeout_s: float = 30,
    interval_s: float = 0.2,
) -> T:
    """Call ``fetch`` until ``until(value)`` holds and return that value; bounded by timeout_s.

    On timeout the AssertionError names ``what`` and the last value fetched, so a failing test
    says what it waited for and what it saw instead of just "timeout".
    """
    return wait_until(
        fetch, timeout=timeout_s, interval=interval_s, message=f"waiting for {what}", until=until
    )


def rest_api(api: client.ApiClient) -> tuple[Api, ApiServer]:
    """``api`` in the stdlib shape the pod runner takes (``ControlPlane.request``'s), and the
    server plus CA that the EPP's kubeconfig needs, for code that holds only a client."""
    conf = api.configuration

    def request(method: str, path: str, body: Any) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        try:
            resp = api.rest_client.request(
                method, conf.host + path, headers=headers, body=body, _request_timeout=10
            )
            status, raw = resp.status, resp.read()
        except ApiException as err:
            status, raw = err.status, err.body
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw

    with open(conf.ssl_ca_cert, "rb") as ca:
        return request, ApiServer(conf.host, base64.b64encode(ca.read()).decode())
