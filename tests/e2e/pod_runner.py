"""The kubelet stand-in of the autoscaling tests: ``tests.cluster.pod_runner.PodRunner`` built
from a ``CoreV1Api``, with the Prometheus file-SD targets file they scrape.

Each engine binds its pod's own IP and the container's port (``<podIP>:8000``); see
tests/cluster/pod_runner.py for what it runs and owns.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kubernetes import client

from tests.cluster import pod_runner
from tests.cluster.client import rest_api
from tests.cluster.pod_runner import PodProcess

Engine = PodProcess  # what tests/e2e/load.py spreads requests over


class PodRunner(pod_runner.PodRunner):
    def __init__(
        self,
        core: client.CoreV1Api,
        namespace: str,
        selector: str,
        targets_file: Path,
        log_dir: Path,
        on_event: Callable[[str], object] = lambda _: None,
        epp_binary: Path | None = None,
    ) -> None:
        api, server = rest_api(core.api_client)
        super().__init__(
            api,
            server,
            namespace,
            selector,
            log_dir,
            targets_file=targets_file,
            epp_binary=epp_binary,
            on_event=on_event,
        )
