"""The engine image, run as the chart runs it, serves the embedded tiny model.

runc runs the exported image as its own user 10001 with a read-only root and a writable ``/tmp``
(the chart's emptyDir); its entrypoint ``quire-engine serve`` listens on a free port of the
host's loopback (the container shares the host's network namespace). The test waits for
``/ready``, asks for a completion, reads ``/metrics``, and finds the native CPU kernels that the
image's own gcc compiled into ``/tmp`` (the Dockerfile's QUIRE_KERNEL_CACHE).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.images.build import BuiltImage
from tests.images.container import Bundle, Container, Mount
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

IMAGE_UID = 10001  # the Dockerfile's USER, the chart's runAsUser


def test_engine_image_serves_the_tiny_model(
    engine_image: BuiltImage, engine_bundle: Bundle, tmp_path: Path
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    scratch.chmod(0o1777)  # an emptyDir: writable by the pod's user
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    container = Container(
        engine_bundle,
        tmp_path / "engine",
        env={"QUIRE_HOST": "127.0.0.1", "QUIRE_PORT": str(port)},
        mounts=[Mount(scratch, "/tmp", writable=True)],
    )
    try:
        # Importing torch from a cold page cache on a busy 2-core machine takes a while.
        wait_until(
            lambda: _get(f"{base}/ready"),
            timeout=600,
            interval=1,
            message=lambda: f"the engine image's /ready\n{container.describe()}",
            ignore=(OSError,),
        )
        assert container.uids() == (IMAGE_UID,) * 4
        request = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        answer = json.loads(_post(f"{base}/v1/completions", request))
        (choice,) = answer["choices"]
        assert answer["usage"]["completion_tokens"] == 8, answer
        assert isinstance(choice["text"], str)
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(_get(f"{base}/metrics"))
            for sample in family.samples
        }
        assert samples["quire_generation_tokens_total"] >= 8, samples
        assert "quire_kv_cache_usage_ratio" in samples
        kernels = wait_until(
            lambda: sorted((scratch / "quire-kernels").glob("*.so")),
            timeout=120,
            interval=1,
            message=lambda: f"native kernels in /tmp/quire-kernels\n{container.describe()}",
        )
        assert all(kernel.stat().st_uid == IMAGE_UID for kernel in kernels)
    finally:
        container.stop()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _post(url: str, body: dict[str, object]) -> str:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return str(response.read().decode())
