"""Operator processes for tests: ``python -m quire_operator`` against the test cluster.

Real processes, not an in-process kopf loop, so a test can SIGKILL one mid-way and start
another, or run two side by side to exercise peering, exactly as replicas in a cluster would.

Ownership: an ``OperatorProcess`` owns its child (a ``tests.cluster.process.ManagedProcess``:
its own session, killed by the kernel if pytest dies) and its log file under the test's tmp dir.
``Operators`` (the ``operators`` fixture) owns every process a test started and stops them all.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.process import ManagedProcess, free_port
from tests.waiting import wait_until

OPERATOR_SOURCE = Path(__file__).resolve().parents[2] / "operator"


class OperatorProcess:
    def __init__(self, name: str, cluster: ClusterHandle, args: list[str], log_path: Path) -> None:
        self.name = name
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        env = shutil.which("env") or "/usr/bin/env"
        argv = [
            # KUBECONFIG for this child only; `env` execs in place, so the pid stays the same.
            # PYTHONPATH: this checkout's operator, whatever the interpreter has installed (an
            # editable install may point at another checkout).
            env,
            f"KUBECONFIG={cluster.kubeconfig}",
            f"PYTHONPATH={OPERATOR_SOURCE}",
            sys.executable,
            "-m",
            "quire_operator",
            *args,
            "--liveness",
            f"http://127.0.0.1:{self.port}/healthz",
            "--metrics-bind-address",
            f"127.0.0.1:{self.metrics_port}",
        ]
        self.process = ManagedProcess(name, argv, log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def describe(self) -> str:
        return self.process.describe_failure(lines=60)

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Until kopf's liveness endpoint answers 200 (startup done, watches starting)."""
        url = f"http://127.0.0.1:{self.port}/healthz"

        def healthy() -> bool:
            if self.process.exited() is not None:
                raise AssertionError(f"{self.name} exited during startup\n{self.describe()}")
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)

        wait_until(
            healthy,
            timeout=timeout_s,
            interval=0.2,
            message=lambda: f"{self.name} not healthy\n{self.describe()}",
            ignore=(urllib.error.URLError, OSError),
        )

    def metrics(self) -> str:
        """The operator's Prometheus exposition (its ``--metrics-bind-address``)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def sample(self, metric: str, labels: Mapping[str, str]) -> float:
        """The value of the operator's sample ``metric`` with exactly ``labels`` (0 if absent)."""
        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                if sample.name == metric and sample.labels == labels:
                    return float(sample.value)
        return 0.0

    def wait_for_log(self, pattern: str, timeout_s: float = 30) -> re.Match[str]:
        """Until a line of the log matches ``pattern`` (a regex); returns the match."""
        return wait_until(
            lambda: re.search(pattern, self.log(), re.MULTILINE),
            timeout=timeout_s,
            interval=0.2,
            message=lambda: (
                f"{self.name}'s log has no line matching {pattern!r}\n" + self.describe()
            ),
        )

    def kill(self) -> None:
        """SIGKILL: a crash, no goodbye to the peering object, no cleanup."""
        self.process.popen.kill()
        self.process.stop()

    def stop(self) -> None:
        """SIGTERM and wait: kopf leaves the peering object on its way out."""
        self.process.stop(grace_s=15)


class Operators:
    """Starts operator processes for one test; ``namespace`` is the default scope."""

    def __init__(self, cluster: ClusterHandle, namespace: str, log_dir: Path) -> None:
        self._cluster = cluster
        self._namespace = namespace
        self._log_dir = log_dir
        self.started: list[OperatorProcess] = []

    def start(self, *args: str, name: str = "operator", wait: bool = True) -> OperatorProcess:
        """``quire-operator -n <namespace> [args]`` unless args name the scope themselves."""
        scoped = any(a in ("-A", "--all-namespaces", "-n", "--namespace") for a in args)
        argv = list(args) if scoped else ["--namespace", self._namespace, *args]
        log_path = self._log_dir / f"{name}-{len(self.started)}.log"
        process = OperatorProcess(name, self._cluster, argv, log_path)
        self.started.append(process)
        if wait:
            process.wait_healthy()
        return process

    def stop_all(self) -> None:
        for process in reversed(self.started):
            process.stop()

    def report(self) -> str:
        return "\n".join(f"{p.describe()}\n" for p in self.started) or "no operator started"


class GarbageCollectorProbe:
    """Tells when the garbage collector follows owner references to InferenceServices.

    kube-controller-manager's garbage collector watches a new resource type only after its
    periodic API discovery (every 30 s) has seen it; until then, deleting an InferenceService
    leaves its children in place. In a real cluster the CRD is installed long before; in a fresh
    test cluster the ``crds`` fixture starts this probe right after applying the CRD (an owner
    deleted at once, a ConfigMap depending on it), and a test relying on garbage collection
    calls ``wait()``, which returns as soon as the ConfigMap is collected.
    """

    def __init__(self, cluster: ClusterHandle) -> None:
        from kubernetes import client

        self._cluster = cluster
        self.namespace = f"gc-probe-{uuid.uuid4().hex[:8]}"
        cluster.core.create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=self.namespace))
        )
        body = {
            "apiVersion": "quire.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "probe"},
            "spec": {"model": {"uri": "tiny"}},
        }
        owner = cluster.json(
            cluster.custom.create_namespaced_custom_object(
                "quire.dev", "v1alpha1", self.namespace, "inferenceservices", body
            )
        )
        reference = client.V1OwnerReference(
            api_version="quire.dev/v1alpha1",
            kind="InferenceService",
            name="probe",
            uid=owner["metadata"]["uid"],
        )
        dependent = client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="probe", owner_references=[reference])
        )
        cluster.core.create_namespaced_config_map(self.namespace, dependent)
        cluster.custom.delete_namespaced_custom_object(
            "quire.dev", "v1alpha1", self.namespace, "inferenceservices", "probe"
        )
        self._collected = False

    def _dependent_gone(self) -> bool:
        listed = self._cluster.core.list_namespaced_config_map(self.namespace)
        return all(
            item["metadata"]["name"] != "probe" for item in self._cluster.json(listed)["items"]
        )

    def wait(self, timeout_s: float = 90) -> None:
        if not self._collected:
            wait_for(
                "the garbage collector to follow owner references to InferenceServices",
                self._dependent_gone,
                bool,
                timeout_s=timeout_s,
                interval_s=1,
            )
            self._collected = True

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the cluster may already be gone
            self._cluster.core.delete_namespace(self.namespace)
