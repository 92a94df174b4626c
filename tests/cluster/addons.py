"""The autoscaling stack on loopback, next to a running ``ControlPlane``: Prometheus, KEDA
(operator + metrics API server) and prometheus-adapter, registered with the API server through
real APIServices.

How the API server reaches an adapter on 127.0.0.1: an ``APIService`` names a Service of type
``ExternalName`` with ``externalName: localhost``; the aggregator resolves such a Service to
``https://localhost:<APIService port>`` (the control plane already runs with the front-proxy
flags, see launcher.py). ``insecureSkipTLSVerify`` because the adapters serve self-signed
certificates; requests still carry the front-proxy client certificate, which the adapters verify
through the ``extension-apiserver-authentication`` ConfigMap.

Ownership: an ``AutoscalingStack`` owns its work dir (Prometheus data, certificates, configs),
its processes (stopped in reverse start order by ``stop``) and the cluster objects it registered
(the APIServices, the ``keda`` namespace); it writes nothing else. Prometheus discovers scrape
targets from one file-SD JSON file (``targets_file``) that someone else (the e2e pod runner)
rewrites; Prometheus rereads it on change.

Stdlib only (like the launcher), so ``python3 -m tests.cluster up --autoscaling`` needs no venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .addons_build import AutoscalingBinaries
from .build import K8S_VERSION
from .launcher import ControlPlane
from .process import ClusterError, ManagedProcess, free_port, wait_until

KEDA_NAMESPACE = "keda"
ADAPTER_NAMESPACE = "monitoring"
# Fast enough that a scaling test sees a change within seconds, and that Prometheus' record
# resolves the KV-demand test's growth phase (under a second on a fast core); the production
# values (15-30 s scrape, 30 s KEDA polling, 1-10 min adapter relist) are in the timing table of
# docs/autoscaling.md.
SCRAPE_INTERVAL = "250ms"
ADAPTER_RELIST = "2s"


@dataclass(frozen=True)
class Timing:
    scrape_interval: str = SCRAPE_INTERVAL
    adapter_relist: str = ADAPTER_RELIST


class AutoscalingStack:
    """Start with ``start_prometheus``, then ``start_keda`` and/or ``start_prometheus_adapter``."""

    def __init__(
        self, cluster: ControlPlane, binaries: AutoscalingBinaries, timing: Timing = Timing()
    ) -> None:
        self.cluster = cluster
        self.binaries = binaries
        self.timing = timing
        self.workdir = Path(tempfile.mkdtemp(prefix="quire-autoscaling-", dir=cluster.workdir))
        self.log_dir = cluster.log_dir
        self.targets_file = self.workdir / "targets.json"
        self.targets_file.write_text("[]\n")
        self.processes: list[ManagedProcess] = []
        self.prometheus_url = ""
        self._registered: list[str] = []  # APIService names
        self._crd_files: list[str] = []  # kubectl -f arguments of the CRDs this stack applied

    # -- lifecycle --------------------------------------------------------------------------

    def stop(self) -> None:
        """Remove the CRDs it applied (while KEDA still runs to clear its finalizers: the cluster
        is shared with tests that need one without KEDA), unregister the APIServices (so the API
        server stops proxying to dead ports), then stop every process. Idempotent."""
        if self._crd_files:
            self.cluster.kubectl("delete", "--ignore-not-found", "--timeout=120s", *self._crd_files)
            self._crd_files.clear()
        for name in reversed(self._registered):
            self.cluster.request("DELETE", f"/apis/apiregistration.k8s.io/v1/apiservices/{name}")
        self._registered.clear()
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def dead_components(self) -> list[str]:
        return [proc.name for proc in self.processes if proc.exited() is not None]

    def log_report(self, lines: int = 40) -> str:
        return "\n".join(proc.describe_failure(lines) for proc in self.processes)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.processes.append(ManagedProcess(name, argv, self.log_dir / f"{name}.log", env=env))

    def _wait(self, what: str, check: Any, timeout_s: float = 120) -> None:
        wait_until(what, check, timeout_s=timeout_s, watch=self.processes)

    # -- Prometheus -------------------------------------------------------------------------

    def start_prometheus(self) -> str:
        """Prometheus scraping the file-SD targets every ``scrape_interval``; returns its URL."""
        port = free_port()
        interval = self.timing.scrape_interval
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {
                    "job_name": "quire-engine",
                    "scrape_timeout": interval,
                    "file_sd_configs": [
                        {"files": [str(self.targets_file)], "refresh_interval": interval}
                    ],
                }
            ],
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
        self._spawn(
            "prometheus",
            [
                str(self.binaries.prometheus),
                f"--config.file={path}",
                f"--storage.tsdb.path={self.workdir / 'prometheus-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=2h",
                "--log.level=warn",
            ],
        )
        self.prometheus_url = f"http://127.0.0.1:{port}"
        self._wait("Prometheus /-/ready", lambda: _http_ok(f"{self.prometheus_url}/-/ready"))
        return self.prometheus_url

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; the result vector (``[{"metric": {...}, "value": [t, "v"]}]``)."""
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as resp:
            reply = json.loads(resp.read())
        if reply.get("status") != "success":
            raise ClusterError(f"Prometheus query {promql!r} failed: {reply}")
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    # -- KEDA -------------------------------------------------------------------------------

    def start_keda(self) -> None:
        """KEDA's CRDs, its operator and metrics API server, and the external metrics
        APIService; returns once the API server reports that APIService Available."""
        files = [arg for crd in self.binaries.keda_crds for arg in ("-f", str(crd))]
        self._crd_files = files
        self.cluster.kubectl("apply", "--server-side", *files)
        self.cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *files)
        self._ensure_namespace(KEDA_NAMESPACE)
        certs = self._certificates("keda")
        grpc_port = free_port()
        env = {
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "WATCH_NAMESPACE": "",
            "POD_NAMESPACE": KEDA_NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
        }
        self._spawn(
            "keda-operator",
            [
                str(self.binaries.keda_operator),
                f"--kubeconfig={self.cluster.kubeconfig}",
                "--leader-elect=false",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                f"--health-probe-bind-address=127.0.0.1:{free_port()}",
                f"--metrics-service-bind-address=127.0.0.1:{grpc_port}",
                f"--cert-dir={certs}",
                f"--ca-dir={certs}",
                "--enable-cert-rotation=false",
                "--zap-log-level=info",
            ],
            env=env,
        )
        port = free_port()
        self._spawn(
            "keda-adapter",
            [
                str(self.binaries.keda_adapter),
                f"--kubeconfig={self.cluster.kubeconfig}",
                f"--lister-kubeconfig={self.cluster.kubeconfig}",
                f"--authentication-kubeconfig={self.cluster.kubeconfig}",
                f"--authorization-kubeconfig={self.cluster.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'tls.crt'}",
                f"--tls-private-key-file={certs / 'tls.key'}",
                f"--metrics-service-address=127.0.0.1:{grpc_port}",
                "--metrics-service-grpc-authority=localhost",
                f"--port={free_port()}",
            ],
            env=env,
        )
        self._register(
            "external.metrics.k8s.io", ["v1beta1"], KEDA_NAMESPACE, "keda-metrics-apiserver", port
        )

    # -- prometheus-adapter ----------------------------------------------------------------

    def start_prometheus_adapter(self, rules_yaml: str) -> None:
        """prometheus-adapter with the given rules (the chart's ConfigMap ``config.yaml``) and
        the custom metrics APIServices (v1beta1 and v1beta2)."""
        if not self.prometheus_url:
            raise ClusterError("start_prometheus() first: the adapter queries it")
        self._ensure_namespace(ADAPTER_NAMESPACE)
        certs = self._certificates("prometheus-adapter")
        rules = self.workdir / "adapter-rules.yaml"
        rules.write_text(rules_yaml)
        port = free_port()
        kubeconfig = str(self.cluster.kubeconfig)
        self._spawn(
            "prometheus-adapter",
            [
                str(self.binaries.prometheus_adapter),
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--prometheus-url={self.prometheus_url}/",
                f"--metrics-relist-interval={self.timing.adapter_relist}",
                f"--config={rules}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'tls.crt'}",
                f"--tls-private-key-file={certs / 'tls.key'}",
                "--v=2",
            ],
        )
        self._register(
            "custom.metrics.k8s.io",
            ["v1beta1", "v1beta2"],
            ADAPTER_NAMESPACE,
            "prometheus-adapter",
            port,
        )

    def chart_adapter_rules(self) -> str:
        """The chart's prometheus-adapter rules exactly as ``helm template`` renders them.

        Stdlib only, so no YAML parser here: the rendered ConfigMap is applied to the adapter's
        namespace with kubectl (the API server parses it) and read back as JSON."""
        chart = Path(__file__).resolve().parents[2] / "charts" / "quire"
        rendered = subprocess.run(
            [str(self.cluster.binaries.helm), "template", "quire", str(chart),
             "--namespace", ADAPTER_NAMESPACE, "--kube-version", K8S_VERSION,
             "--show-only", "templates/adapter-rules.yaml"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        if rendered.returncode != 0:
            raise ClusterError(f"helm template failed:\n{rendered.stderr}")
        self._ensure_namespace(ADAPTER_NAMESPACE)
        self.cluster.kubectl("apply", "--server-side", "-f", "-", stdin=rendered.stdout)
        path = f"/api/v1/namespaces/{ADAPTER_NAMESPACE}/configmaps/quire-adapter-rules"
        status, config_map = self.cluster.request("GET", path)
        if status != 200:
            raise ClusterError(f"GET {path}: {status} {config_map}")
        rules: str = config_map["data"]["config.yaml"]
        return rules

    # -- helpers ----------------------------------------------------------------------------

    def _register(
        self, group: str, versions: list[str], namespace: str, service: str, port: int
    ) -> None:
        """ExternalName Service -> localhost, one APIService per version; waits for Available."""
        svc = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": service, "namespace": namespace},
            "spec": {"type": "ExternalName", "externalName": "localhost"},
        }
        self._create(f"/api/v1/namespaces/{namespace}/services", svc)
        for version in versions:
            name = f"{version}.{group}"
            api_service = {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": name},
                "spec": {
                    "group": group,
                    "version": version,
                    "service": {"namespace": namespace, "name": service, "port": port},
                    "insecureSkipTLSVerify": True,
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            }
            path = "/apis/apiregistration.k8s.io/v1/apiservices"
            self.cluster.request("DELETE", f"{path}/{name}")  # a leftover from a killed run
            self._create(path, api_service)
            self._registered.append(name)
            self._wait(f"APIService {name} Available", lambda n=name: self._available(n))

    def _available(self, name: str) -> bool:
        status, reply = self.cluster.request(
            "GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{name}"
        )
        if status != 200:
            return False
        conditions = reply.get("status", {}).get("conditions") or []
        return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)

    def _create(self, path: str, body: dict[str, Any]) -> None:
        status, reply = self.cluster.request("POST", path, body)
        if status not in (201, 409):
            raise ClusterError(f"POST {path}: {status} {reply}")

    def _ensure_namespace(self, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        self._create("/api/v1/namespaces", body)

    def _certificates(self, name: str) -> Path:
        return make_certificates(self.workdir / f"{name}-certs", name)


def make_certificates(out: Path, name: str) -> Path:
    """A CA and one certificate for 127.0.0.1/localhost usable as server and client (KEDA's
    operator and adapter authenticate each other over gRPC with mutual TLS; a webhook server
    needs a server certificate the API server trusts through ``ca.crt``) in ``out``: ca.crt,
    tls.crt, tls.key, the file names KEDA and controller-runtime expect in a --cert-dir."""
    out.mkdir()
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ClusterError(f"{name} needs the `openssl` command for its certificates")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], capture_output=True, check=True, cwd=out)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "7",
        "-subj", f"/CN={name}-ca")  # fmt: skip
    run("req", "-new", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=localhost")
    (out / "tls.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"
    )
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "7", "-extfile", "tls.ext", "-out", "tls.crt")  # fmt: skip
    return out


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)
