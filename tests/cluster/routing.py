"""The routing stack next to a running ``ControlPlane``: Gateway API Inference Extension's CRDs,
the kubelet stand-in that runs engine and Endpoint Picker pods, and Envoy gateways.

What runs where (all on this machine, no containers):

- the CRDs the EPP watches (``InferencePool`` v1, ``InferenceObjective``,
  ``InferenceModelRewrite``), applied from the module source the EPP was built from;
- a ``PodRunner`` per namespace and selector: each engine pod's ``quire-engine`` on
  ``<podIP>:8000`` and each EPP pod's ``epp`` with the pod's own args (pod_launch.py);
- a ``Gateway`` per EPP: Envoy with GIE's ext_proc + original-destination configuration.

Ownership: a ``RoutingStack`` owns the CRDs it applied (deleted by ``stop``, so the shared
cluster returns to having none), and every runner and gateway it made (stopped by ``stop``, the
gateways first, so no request is in flight when the processes go). Its work dir lives in the
cluster's and goes with it.

Stdlib only (like the launcher), so ``python3 -m tests.cluster up --routing`` needs no venv.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .gateway import Gateway, GatewayConfig, ServiceConfig
from .launcher import ControlPlane
from .pod_runner import ApiServer, PodRunner
from .routing_build import RoutingBinaries

INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"
GIE_CRD_NAMES = (
    INFERENCE_POOL_CRD,
    "inferenceobjectives.inference.networking.x-k8s.io",
    "inferencemodelrewrites.inference.networking.x-k8s.io",
)


class RoutingStack:
    def __init__(self, cluster: ControlPlane, binaries: RoutingBinaries) -> None:
        self.cluster = cluster
        self.binaries = binaries
        self.workdir = Path(tempfile.mkdtemp(prefix="quire-routing-", dir=cluster.workdir))
        self.log_dir = cluster.log_dir
        self.runners: list[PodRunner] = []
        self.gateways: list[Gateway] = []
        self._crd_files: list[str] = []

    def install_crds(self) -> None:
        """Apply the GIE CRDs and wait until the API server serves them."""
        files = [arg for crd in self.binaries.crds for arg in ("-f", str(crd))]
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", *files)
        self._crd_files = files
        self.cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *files)

    def pod_runner(
        self,
        namespace: str,
        selector: str,
        *,
        log_dir: Path | None = None,
        targets_file: Path | None = None,
        on_event: Callable[[str], object] = lambda _: None,
    ) -> PodRunner:
        """A started kubelet stand-in for the pods of ``namespace`` matching ``selector``."""
        runner = PodRunner(
            self.cluster.request,
            ApiServer.from_kubeconfig(self.cluster.kubeconfig),
            namespace,
            selector,
            log_dir or self.log_dir,
            targets_file=targets_file,
            epp_binary=self.binaries.epp,
            on_event=on_event,
        )
        self.runners.append(runner)
        runner.start()
        return runner

    def gateway(
        self, config: GatewayConfig | ServiceConfig, *, log_dir: Path | None = None
    ) -> Gateway:
        """A started Envoy in front of ``config.epp``, or standing in for a Service over
        ``config.endpoints`` (returns once Envoy is ready)."""
        name = f"envoy-{len(self.gateways)}"
        gateway = Gateway(
            self.binaries.envoy, config, self.workdir, log_dir or self.log_dir, name=name
        )
        self.gateways.append(gateway)
        return gateway.start()

    def report(self, lines: int = 30) -> str:
        """Errors and log tails of every pod process and gateway, for a failing test."""
        parts = [f"pod runner errors: {r.errors}\n{r.report(lines)}" for r in self.runners]
        for gateway in self.gateways:
            if gateway.process is not None:
                parts.append(gateway.process.describe_failure(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Gateways, then runners, then the CRDs. Idempotent."""
        for gateway in reversed(self.gateways):
            gateway.stop()
        self.gateways.clear()
        for runner in reversed(self.runners):
            runner.stop()
        self.runners.clear()
        if self._crd_files:
            self.cluster.kubectl("delete", "--ignore-not-found", "--timeout=120s", *self._crd_files)
            self._crd_files.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
