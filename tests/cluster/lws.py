"""The LeaderWorkerSet add-on on loopback, next to a running ``ControlPlane``: the
``sigs.k8s.io/lws`` controller with its admission webhooks, and its CRDs.

How the API server reaches the webhooks on 127.0.0.1: the shipped webhook configurations
(``config/webhook/manifests.yaml`` of the module) name an in-cluster Service; here each
``clientConfig`` becomes ``url: https://127.0.0.1:<port><path>`` with the CA of a certificate made
for 127.0.0.1 (``addons.make_certificates``) as ``caBundle``, and the controller serves its
webhooks there (its Configuration file: ``webhook.host``/``port``/``certDir``, internal cert
management off). The pod webhooks get the ``objectSelector`` the release adds
(``config/webhook/*-patch.yaml``: only pods labelled ``leaderworkerset.sigs.k8s.io/name``), so the
shared cluster's other pods never pass through them. Everything else is the release's: the
controller creates the leader StatefulSet, one worker StatefulSet per group and the headless
Service, and its pod webhook writes the ``LWS_*`` variables into every group pod (which
pod_launch.py then resolves as a kubelet and cluster DNS would).

Ownership: an ``LwsStack`` owns its work dir (certificates, the controller's Configuration), the
controller process, the two webhook configurations and the CRDs it applied; ``stop`` removes
the webhook configurations first (with ``failurePolicy: Fail`` a dead webhook would refuse every
LeaderWorkerSet pod), then the CRDs (the controller still running to let their objects go),
then stops the controller. Idempotent.

Stdlib only (like the launcher).
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from .addons import make_certificates
from .launcher import ControlPlane
from .lws_build import LwsBinaries
from .process import ClusterError, ManagedProcess, free_port, wait_until

NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
# The release's kustomize namePrefix; the configurations are cluster-scoped.
CONFIG_PREFIX = "lws-"
POD_WEBHOOK_PATHS = ("/mutate--v1-pod", "/validate--v1-pod")
WEBHOOK_KINDS = {
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
}


class LwsStack:
    def __init__(self, cluster: ControlPlane, binaries: LwsBinaries) -> None:
        self.cluster = cluster
        self.binaries = binaries
        self.workdir = Path(tempfile.mkdtemp(prefix="quire-lws-", dir=cluster.workdir))
        self.process: ManagedProcess | None = None
        self._webhooks: list[str] = []  # API paths of the configurations it created
        self._crd_args: list[str] = []

    def start(self, timeout_s: float = 120) -> None:
        """CRDs, the controller, then its webhook configurations; returns once the webhooks
        answer (a server-side dry-run create of a LeaderWorkerSet passes through them)."""
        self._crd_args = [arg for crd in self.binaries.crds for arg in ("-f", str(crd))]
        crds = self._crd_args
        self.cluster.kubectl("apply", "--server-side", *crds)
        self.cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crds)
        certs = make_certificates(self.workdir / "certs", "lws-webhook")
        port, health = free_port(), free_port()
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": port, "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        }
        config_path = self.workdir / "config.yaml"
        config_path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
        argv = [
            str(self.binaries.controller),
            f"--config={config_path}",
            f"--kubeconfig={self.cluster.kubeconfig}",
            "--zap-log-level=info",
        ]
        log = self.cluster.log_dir / "lws-controller.log"
        self.process = ManagedProcess("lws-controller", argv, log)
        watch = [self.process]
        wait_until(
            "LWS controller /healthz",
            lambda: _ok(f"http://127.0.0.1:{health}/healthz"),
            timeout_s=timeout_s,
            watch=watch,
        )
        wait_until("LWS webhook server", lambda: _tls_up(port), timeout_s=timeout_s, watch=watch)
        ca = base64.b64encode((certs / "ca.crt").read_bytes()).decode()
        for body in self._webhook_configurations(port, ca):
            path = f"/apis/admissionregistration.k8s.io/v1/{WEBHOOK_KINDS[body['kind']]}"
            status, reply = self.cluster.request("POST", path, body)
            if status == 409:  # left over from a run that was killed: replace it
                name = body["metadata"]["name"]
                self.cluster.request("DELETE", f"{path}/{name}")
                status, reply = self.cluster.request("POST", path, body)
            if status != 201:
                raise ClusterError(f"POST {path}: {status} {reply}")
            self._webhooks.append(f"{path}/{body['metadata']['name']}")
        wait_until(
            "LWS webhooks admitting a LeaderWorkerSet",
            self._admits,
            timeout_s=timeout_s,
            watch=watch,
        )

    def _webhook_configurations(self, port: int, ca: str) -> list[dict[str, Any]]:
        """The shipped configurations, pointed at the local server."""
        text = self.cluster.kubectl(
            "create", "--dry-run=client", "-o", "json", "-f", str(self.binaries.webhooks)
        )
        items = _json_documents(text)  # one object per YAML document
        for item in items:
            item["metadata"] = {"name": CONFIG_PREFIX + item["metadata"]["name"]}
            for hook in item["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
                if path in POD_WEBHOOK_PATHS:
                    hook["objectSelector"] = {
                        "matchExpressions": [{"key": NAME_LABEL, "operator": "Exists"}]
                    }
        return list(items)

    def _admits(self) -> bool:
        """A dry-run create in ``default`` goes through the mutating and validating webhooks."""
        container = {"name": "c", "image": "none"}
        body = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": {"name": "quire-webhook-probe", "namespace": "default"},
            "spec": {
                "leaderWorkerTemplate": {
                    "size": 2,
                    "workerTemplate": {"spec": {"containers": [container]}},
                }
            },
        }
        path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets?dryRun=All"
        status, reply = self.cluster.request("POST", path, body)
        if status != 201:
            return False
        # The mutating webhook defaulted it: proof that the API server called the controller.
        return bool(reply["spec"]["leaderWorkerTemplate"].get("restartPolicy"))

    def stop(self) -> None:
        for path in self._webhooks:
            self.cluster.request("DELETE", path)
        self._webhooks.clear()
        if self._crd_args and (self.process is None or self.process.exited() is None):
            self.cluster.kubectl("delete", "--ignore-not-found", "--timeout=120s", *self._crd_args)
        self._crd_args.clear()
        if self.process is not None:
            self.process.stop()
            self.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def report(self, lines: int = 40) -> str:
        return self.process.describe_failure(lines) if self.process is not None else ""


def _json_documents(text: str) -> list[dict[str, Any]]:
    """Concatenated JSON objects (what ``kubectl -o json`` prints for several documents)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        obj, at = decoder.raw_decode(text, at)
        found.append(obj)
    return found


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return bool(resp.status == 200)


def _tls_up(port: int) -> bool:
    """The webhook server completes a TLS handshake (it starts after the certificates load)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=2) as sock,
        context.wrap_socket(sock) as tls,
    ):
        return tls.version() is not None
