"""Certificates and keys for one throwaway test cluster, made with the ``openssl`` command.

Ownership: everything is written into a directory the caller owns (the launcher's temp dir) and
dies with it; nothing here is reused across clusters, so the keys are short-lived and unshared.

Why openssl and not a Python crypto library: the openssl CLI is on every machine this project
runs on, while the test environment has no ``cryptography`` package. ECDSA P-256 keys are used
throughout because generating them takes milliseconds (RSA-2048 takes noticeably longer) and
every component (kube-apiserver, service-account token signing, Python's ssl) accepts them.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Valid long enough for any test session or a day of `python -m tests.cluster up`.
_DAYS = "7"


class PKIError(RuntimeError):
    """openssl is missing or refused to make a certificate."""


@dataclass(frozen=True)
class ClusterPKI:
    """Paths of the PEM files one cluster needs."""

    ca_cert: Path  # signs the API server's serving cert and every client cert
    ca_key: Path
    serving_cert: Path  # kube-apiserver's HTTPS cert for 127.0.0.1 / localhost
    serving_key: Path
    admin_cert: Path  # CN=quire-admin, O=system:masters: full access, used by everyone here
    admin_key: Path
    front_proxy_ca_cert: Path  # trusts the aggregator's client cert toward extension API servers
    front_proxy_client_cert: Path
    front_proxy_client_key: Path
    sa_key: Path  # signs service-account tokens (private) ...
    sa_pub: Path  # ... and verifies them (public)


def make_pki(directory: Path, service_ip: str) -> ClusterPKI:
    """Create a CA, the API server's serving cert, an admin client cert and the SA key pair."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise PKIError("the test cluster needs the `openssl` command (Debian package openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    d = directory

    def run(*args: str) -> None:
        proc = subprocess.run([openssl, *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise PKIError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")

    def key(path: Path) -> Path:
        run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
        return path

    def ca(name: str, subject: str) -> tuple[Path, Path]:
        ca_key = key(d / f"{name}.key")
        ca_cert = d / f"{name}.crt"
        run(
            "req", "-x509", "-new", "-key", str(ca_key), "-out", str(ca_cert), "-days", _DAYS,
            "-subj", subject,
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip
        return ca_cert, ca_key

    def leaf(name: str, subject: str, ca_pair: tuple[Path, Path], extensions: str) -> Path:
        leaf_key = key(d / f"{name}.key")
        csr = d / f"{name}.csr"
        ext = d / f"{name}.ext"
        ext.write_text(extensions)
        run("req", "-new", "-key", str(leaf_key), "-subj", subject, "-out", str(csr))
        cert = d / f"{name}.crt"
        run(
            "x509", "-req", "-in", str(csr), "-CA", str(ca_pair[0]), "-CAkey", str(ca_pair[1]),
            "-CAcreateserial", "-days", _DAYS, "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        return cert

    root = ca("ca", "/CN=quire-test-cluster-ca")
    serving = leaf(
        "apiserver",
        "/CN=kube-apiserver",
        root,
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        # Clients reach the server as 127.0.0.1 or localhost; in-cluster names and the Service
        # IP are there so a pod-shaped client's config (kubernetes.default.svc) would verify too.
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        f"DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:{service_ip}\n",
    )
    client_ext = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    client_ext += "extendedKeyUsage=clientAuth\n"
    # RBAC grants the group system:masters everything; the CN is just the user name in logs.
    admin = leaf("admin", "/O=system:masters/CN=quire-admin", root, client_ext)
    front_ca = ca("front-proxy-ca", "/CN=quire-front-proxy-ca")
    front_client = leaf("front-proxy-client", "/CN=front-proxy-client", front_ca, client_ext)
    sa_key = key(d / "sa.key")
    sa_pub = d / "sa.pub"
    run("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
    return ClusterPKI(
        ca_cert=root[0],
        ca_key=root[1],
        serving_cert=serving,
        serving_key=d / "apiserver.key",
        admin_cert=admin,
        admin_key=d / "admin.key",
        front_proxy_ca_cert=front_ca[0],
        front_proxy_client_cert=front_client,
        front_proxy_client_key=d / "front-proxy-client.key",
        sa_key=sa_key,
        sa_pub=sa_pub,
    )
