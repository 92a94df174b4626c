"""The operator image, run as the chart runs it, reconciles examples/tiny-cpu.yaml on the test
cluster's real API server.

runc runs the exported image as its own user 10001 with a read-only root, no capabilities and an
emptyDir-like ``/tmp``; a flattened admin kubeconfig is mounted where a pod would have its
service account token (the test cluster's API server is on the host's loopback, which the
container shares). The operator's arguments are the chart's (charts/quire/templates/
deployment.yaml), with its liveness and metrics ports moved to free loopback ports.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.cluster.client import ClusterHandle, wait_for
from tests.images.build import BuiltImage, ImageKind
from tests.images.container import Bundle, Container, Mount
from tests.operator_tests.operator_process import GarbageCollectorProbe
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
IMAGE_UID = 10001  # the Dockerfile's USER, the chart's runAsUser


def test_operator_image_reconciles_tiny_cpu(
    cluster: ClusterHandle,
    crds: GarbageCollectorProbe,
    namespace: str,
    operator_image: BuiltImage,
    operator_bundle: Bundle,
    tmp_path: Path,
) -> None:
    secrets = tmp_path / "kubeconfig"
    secrets.mkdir()
    flattened = cluster.kubectl("config", "view", "--raw", "--flatten")
    assert flattened.returncode == 0, flattened.stderr
    (secrets / "config").write_text(flattened.stdout)
    (secrets / "config").chmod(0o644)  # readable by the image's user, as a projected volume
    scratch = tmp_path / "tmp"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)
    liveness, metrics = free_port(), free_port()
    engine_image = f"{ImageKind.ENGINE.repository}:{operator_image.version}"
    container = Container(
        operator_bundle,
        tmp_path / "operator",
        args=[
            f"--namespace={namespace}",
            f"--engine-image={engine_image}",
            "--cluster-domain=cluster.local",
            f"--liveness=http://127.0.0.1:{liveness}/healthz",
            f"--metrics-bind-address=127.0.0.1:{metrics}",
            "--log-format=text",
        ],
        env={"KUBECONFIG": "/var/run/quire/kubeconfig/config"},
        mounts=[
            Mount(secrets, "/var/run/quire/kubeconfig"),
            Mount(scratch, "/tmp", writable=True),
        ],
    )
    try:
        wait_until(
            lambda: _healthy(liveness),
            timeout=120,
            interval=0.5,
            message=lambda: f"the operator image's /healthz\n{container.describe()}",
            ignore=(OSError,),
        )
        assert container.uids() == (IMAGE_UID,) * 4
        applied = cluster.kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
        assert applied.returncode == 0, applied.stderr
        deployment = wait_for(
            "the Deployment the operator image makes for tiny-cpu",
            lambda: _deployment(cluster, namespace),
            lambda found: found is not None,
            timeout_s=120,
        )
        assert deployment is not None, container.describe()
        pod = deployment["spec"]["template"]["spec"]
        (engine,) = pod["containers"]
        assert engine["image"] == engine_image
        assert pod["securityContext"]["runAsUser"] == IMAGE_UID
    finally:
        container.stop()
    assert "Traceback" not in container.log(), container.describe()


def _healthy(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
        return bool(response.status == 200)


def _deployment(cluster: ClusterHandle, namespace: str) -> dict[str, Any] | None:
    """The tiny-cpu Deployment as the API's JSON, None while there is none."""
    try:
        found = cluster.apps.read_namespaced_deployment("tiny-cpu", namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    return cluster.json(found)
