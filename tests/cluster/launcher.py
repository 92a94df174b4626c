"""Start a real Kubernetes control plane on 127.0.0.1, the way controller-runtime's envtest does.

Components, in start order: etcd, kube-apiserver, then kube-controller-manager, kube-scheduler
and kwok (which fakes the nodes and the kubelets, so pods become Running without containers).

Ownership: a ``ControlPlane`` owns
- its work dir (``$TMPDIR/quire-cluster-*``: certificates, the admin kubeconfig, kwok's config),
  removed on stop;
- etcd's data dir (``/dev/shm/quire-etcd-*``, tmpfs: nothing needs to survive, and a RAM-backed
  store makes startup and writes fast), removed on stop;
- its log dir (``$TMPDIR/quire-cluster-logs-*``), removed on stop unless ``keep_logs`` is set,
  so the logs of a failed run survive for the person reading the failure;
- its pod network (``pod_network``: a 127.N.0.0/16 held for it alone), released on stop;
- the five child processes, stopped in reverse start order on stop (and SIGKILLed by the kernel
  if the Python process itself dies, see ``process._die_with_parent``).

Stdlib only, so ``python3 -m tests.cluster up`` needs no virtualenv.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from .build import Binaries
from .nodes import KWOK_ANNOTATION_SELECTOR, fake_nodes
from .pki import make_pki
from .podnet import PodNetwork
from .process import (
    ClusterError,
    ManagedProcess,
    claim,
    free_port,
    shm_dir,
    sweep_stale,
    wait_until,
)

_WORKDIR_PREFIX = "quire-cluster-"  # the logs dir shares it but has no owner file: never swept
_ETCD_PREFIX = "quire-etcd-"

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the first address: the `kubernetes` Service's ClusterIP
# Pod IPs are loopback addresses, unique per pod and per cluster (``pod_network``, podnet.py): a
# real process may bind its pod's IP. Service IPs stay virtual: nothing proxies them.

# Controllers the tests and the operator rely on. Node IPAM, volumes and certificates are left
# out: kwok plays the kubelet and there is no storage or CSR flow to exercise.
CONTROLLERS = (
    # Removes the node.kubernetes.io/not-ready taint that the API server's TaintNodesByCondition
    # admission puts on every new node, once kwok reports it Ready (nothing schedules before).
    "node-lifecycle-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "job-controller",
    "garbage-collector-controller",
    "horizontal-pod-autoscaler-controller",
    "disruption-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "pod-garbage-collector-controller",
    # Static provisioning: a test's PersistentVolume is bound to the claim that matches it, and
    # the protection finalizers the API server puts on claims and volumes are removed once
    # nothing uses them (without these, deleting a namespace with a claim would hang).
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
)
# kwok's pod-complete Stage ends every Running pod of a Job at once without running anything;
# it is left out, so a Job's pod ends when whatever runs it reports so (pod_runner.py).
KWOK_LEFT_OUT_STAGES = ("pod-complete",)
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# Short so HPA tests see the controller act within seconds (the default is 15s).
HPA_SYNC_PERIOD = "2s"


class ControlPlane:
    """A running test cluster; use as a context manager or call ``start``/``stop``."""

    def __init__(self, binaries: Binaries, *, startup_timeout_s: float = 90.0) -> None:
        self.binaries = binaries
        self.startup_timeout_s = startup_timeout_s
        shm = shm_dir()
        sweep_stale(Path(tempfile.gettempdir()), _WORKDIR_PREFIX)
        if shm is not None:
            sweep_stale(shm, _ETCD_PREFIX)
        self.workdir = claim(Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX)))
        self.log_dir = Path(tempfile.mkdtemp(prefix="quire-cluster-logs-"))
        self.etcd_dir = claim(Path(tempfile.mkdtemp(prefix=_ETCD_PREFIX, dir=shm or self.workdir)))
        self.kubeconfig = self.workdir / "kubeconfig"
        self.pod_network = PodNetwork()
        self.processes: list[ManagedProcess] = []
        self.server = ""
        self.startup_s = 0.0
        self._ssl: ssl.SSLContext | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop(keep_logs=exc_type is not None)

    def start(self) -> None:
        """Start every component and return once nodes are Ready and controllers are working.

        On failure everything started so far is stopped (logs kept) before the error propagates.
        """
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop(keep_logs=True)
            raise
        self.startup_s = time.monotonic() - started

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop all components (reverse order) and delete the work and etcd dirs. Idempotent."""
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        self.pod_network.release()
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self.etcd_dir, ignore_errors=True)
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def restart_apiserver(self) -> float:
        """Stop kube-apiserver (SIGTERM, as a rolling control-plane upgrade does) and start it
        again with the same flags and port; returns once /readyz answers 200, with the seconds
        it was away. Clients see their connections dropped and watches end meanwhile."""
        (index,) = [i for i, p in enumerate(self.processes) if p.name == "kube-apiserver"]
        old = self.processes[index]
        started = time.monotonic()
        old.stop()
        self.processes[index] = ManagedProcess(old.name, old.argv, old.log_path)
        self._wait("kube-apiserver /readyz", lambda: self.request("GET", "/readyz")[0] == 200)
        return time.monotonic() - started

    def dead_components(self) -> list[str]:
        """Names of components that have exited (a healthy cluster returns [])."""
        return [proc.name for proc in self.processes if proc.exited() is not None]

    def log_report(self, lines: int = 40) -> str:
        """The tail of every component's log, for attaching to a failing test's report."""
        return "\n".join(proc.describe_failure(lines) for proc in self.processes)

    # -- REST helpers (stdlib; the Python client is the tests' business) -------------------

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One authenticated call to the API server as the admin user; returns (status, JSON)."""
        if self._ssl is None:
            raise ClusterError("request() called before start() created the certificates")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=10) as resp:
                raw = resp.read()
                status: int = resp.status
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def kubectl(self, *args: str, stdin: str | None = None, timeout_s: float = 120) -> str:
        """Run the cached kubectl as the admin user; its stdout, or ClusterError on failure."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        # kubectl's discovery cache goes in the work dir, not in $HOME (or the cwd without one).
        cache = f"--cache-dir={self.workdir / 'kubectl-cache'}"
        proc = subprocess.run(
            [str(self.binaries.kubectl), cache, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
        if proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args[:2])} failed:\n{proc.stderr}")
        return proc.stdout

    # -- startup ----------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log")
        self.processes.append(proc)
        return proc

    def _wait(self, what: str, check: Any) -> None:
        wait_until(what, check, timeout_s=self.startup_timeout_s, watch=self.processes)

    def _start(self) -> None:
        b = self.binaries
        pki = make_pki(self.workdir / "pki", SERVICE_IP)
        etcd_port, etcd_peer_port, api_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{etcd_peer_port}"
        self.server = f"https://127.0.0.1:{api_port}"
        self._ssl = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._ssl.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        self._write_kubeconfig(pki.ca_cert, pki.admin_cert, pki.admin_key)

        # Single member, loopback only. --unsafe-no-fsync: the data is thrown away anyway, and
        # fsync latency (even on tmpfs it is a syscall per write) dominates API write time.
        self._spawn("etcd", [
            str(b.etcd), "--name=quire-test", f"--data-dir={self.etcd_dir}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=quire-test={peer_url}", "--unsafe-no-fsync", "--log-level=warn",
        ])  # fmt: skip
        self._wait("etcd /health", lambda: _http_ok(f"{etcd_url}/health"))

        self._spawn("kube-apiserver", [
            str(b.kube_apiserver), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}", f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
            f"--client-ca-file={pki.ca_cert}", "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            # Front-proxy identity, so aggregated API servers (e.g. a metrics adapter on
            # loopback behind an APIService) can trust requests the API server proxies.
            f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki.front_proxy_client_cert}",
            f"--proxy-client-key-file={pki.front_proxy_client_key}",
            # The `kubernetes` Service's endpoints would be 127.0.0.1, which endpoint
            # validation rejects as loopback; nothing in the tests dials it, so skip them.
            "--endpoint-reconciler-type=none",
            # On top of the default plugins (PodSecurity among them): setting an owner
            # reference with blockOwnerDeletion then needs update on the owner's finalizers,
            # as on OpenShift and hardened clusters, so the chart's RBAC is proven against it.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            "--allow-privileged=true", "--profiling=false",
        ])  # fmt: skip
        self._wait("kube-apiserver /readyz", lambda: self.request("GET", "/readyz")[0] == 200)

        kubeconfig = str(self.kubeconfig)
        # All three run as the admin user (system:masters). Per-component RBAC identities would
        # add certificates and nothing the tests check; the operator gets its own RBAC via helm.
        self._spawn("kube-controller-manager", [
            str(b.kube_controller_manager), f"--kubeconfig={kubeconfig}",
            "--leader-elect=false", "--secure-port=0", f"--controllers={','.join(CONTROLLERS)}",
            f"--root-ca-file={pki.ca_cert}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}",
            "--kube-api-qps=100", "--kube-api-burst=200",
        ])  # fmt: skip
        self._spawn("kube-scheduler", [
            str(b.kube_scheduler), f"--kubeconfig={kubeconfig}",
            "--leader-elect=false", "--secure-port=0",
            "--kube-api-qps=100", "--kube-api-burst=200",
        ])  # fmt: skip
        # --node-ip=127.0.0.1: the API server dials a node's InternalIP for logs/exec; loopback
        # keeps any such call on this machine (it is refused, there is no kubelet).
        self._spawn("kwok", [
            str(b.kwok), f"--kubeconfig={kubeconfig}", f"--config={self._kwok_stages()}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION_SELECTOR}",
            f"--cidr={self.pod_network.default_cidr}", "--node-ip=127.0.0.1",
            "--node-lease-duration-seconds=40",
        ])  # fmt: skip

        nodes = fake_nodes([self.pod_network.node_cidr(i) for i in range(len(fake_nodes()))])
        for node in nodes:
            status, reply = self.request("POST", "/api/v1/nodes", node)
            if status != 201:
                raise ClusterError(f"creating node {node['metadata']['name']}: {status} {reply}")
        names = {node["metadata"]["name"] for node in nodes}
        self._wait("fake nodes Ready and untainted", lambda: self._ready_nodes() >= names)
        # The serviceaccount controller creating `default` proves the controller manager is up;
        # pods cannot be admitted in a namespace before its `default` ServiceAccount exists.
        self._wait(
            "default ServiceAccount (kube-controller-manager)",
            lambda: (
                self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
            ),
        )

    def _kwok_stages(self) -> Path:
        """kwok's Stage configs without KWOK_LEFT_OUT_STAGES, written to the work dir."""
        documents = self.binaries.kwok_stages.read_text().split("\n---\n")
        kept = [
            doc for doc in documents
            if not any(f"\n  name: {name}\n" in doc for name in KWOK_LEFT_OUT_STAGES)
        ]  # fmt: skip
        path = self.workdir / "kwok-stages.yaml"
        path.write_text("\n---\n".join(kept))
        return path

    def _ready_nodes(self) -> set[str]:
        """Nodes that kwok reports Ready and the node lifecycle controller has untainted."""
        status, reply = self.request("GET", "/api/v1/nodes")
        if status != 200:
            return set()
        ready = set()
        for node in reply.get("items", []):
            conditions = node.get("status", {}).get("conditions") or []
            taints = node.get("spec", {}).get("taints") or []
            is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            if is_ready and not any(t["key"] == NOT_READY_TAINT for t in taints):
                ready.add(node["metadata"]["name"])
        return ready

    def _write_kubeconfig(self, ca: Path, cert: Path, key: Path) -> None:
        """Self-contained (certs inlined) so the file can be copied anywhere. JSON is YAML."""

        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "quire-test", "cluster": {
                "server": self.server, "certificate-authority-data": b64(ca)}}],
            "users": [{"name": "quire-admin", "user": {
                "client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
            "contexts": [{"name": "quire-test", "context": {
                "cluster": "quire-test", "user": "quire-admin", "namespace": "default"}}],
            "current-context": "quire-test",
        }  # fmt: skip
        self.kubeconfig.write_text(json.dumps(config, indent=2) + "\n")
        self.kubeconfig.chmod(0o600)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)
