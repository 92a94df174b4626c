"""What the kubelet stand-in runs for one pod: the pod's own container, as a local process.

``plan(pod, api, ...)`` turns a Running pod (its API JSON) into a ``Launch``: argv, environment,
and the addresses it will listen on. It does what a kubelet would do for that container, on
loopback, with these replacements (everything else is the pod's own, so the operator's flags are
what runs):

- **quire-engine** (``command: [quire-engine]``): ``--host`` becomes the pod's IP (a unique
  ``127.N.x.y``, see podnet.py) and ``--port`` stays the container's, so every engine listens on
  ``<podIP>:8000`` as on a real cluster; it runs as ``python -m quire_engine.cli``.
- **Endpoint Picker** (image ``.../epp:<tag>``, or ``command: [/epp]``): the binary from the
  routing add-on. It listens on all interfaces (``:port``, no address flag), so its three ports
  (``--grpc-port``, ``--grpc-health-port``, ``--metrics-port``) are replaced with free ones;
  ``Launch.ports`` maps the container's port to the one really bound. It talks to the API
  server as the pod's ServiceAccount (a TokenRequest-minted token in a kubeconfig named by
  ``KUBECONFIG``), so the RBAC the operator grants is what it gets; with
  ``automountServiceAccountToken: false`` it has no credentials, as in a real pod.

- **headless engine** (a quire-engine with ``--headless``: a LeaderWorkerSet worker): the same,
  but it serves no HTTP (``Workload.ENGINE_NODE``); it counts as ready while it runs, as a
  container without probes does.
- **LeaderWorkerSet pods**: ``LWS_LEADER_ADDRESS`` (the leader pod's DNS name,
  ``<pod>.<subdomain>.<namespace>``, which cluster DNS would resolve through the headless
  Service) becomes that pod's IP, read from the API (a LaunchError, retried, until it has one).
- **init containers** of an engine pod: the engine's own ``hf download`` (an hf:// model without
  a cache) runs as this interpreter's ``hf`` CLI, each to completion before the engine
  (``init_chain``); any other init container is a ``LaunchError``.
- **model cache download** (``command: [python, -m, quire_engine.hub_cache, ...]``, the
  operator's download Job): this interpreter runs the module. Its termination message file
  (``terminationMessagePath``) is a local file, ``Launch.termination_log``, which the runner
  reports in the pod's status when the process ends.

For all: ``env`` entries (``value``, ``fieldRef``, ``configMapKeyRef``, ``secretKeyRef``) are
resolved and ``$(VAR)`` references in args expanded. ConfigMap and Secret volumes are written
under ``files_dir``, emptyDirs are empty directories there, and a PersistentVolumeClaim is the
directory of the PersistentVolume bound to it (``hostPath`` or ``local``: the test made it, on
this machine); any argument or environment value that names a path under a ``mountPath`` is
pointed at the local directory. A directory that only holds mounts (``/adapters`` holding
``/adapters/hf`` and ``/adapters/pvc/<claim>``) is made as a runtime composes a container's
root: a local directory whose entries link to the mounts' local directories, so a process given
that directory finds each mount under it. A claim not bound yet raises ``LaunchError`` (the runner
retries, as a kubelet waits for the volume).

Stdlib only; ``api`` is ``ControlPlane.request``'s shape: ``(method, path, body) -> (status,
json)``.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from .process import free_port

Api = Callable[[str, str, Any], tuple[int, Any]]

ENGINE_PORT = 8000  # quire-engine's default, and the operator's containerPort
# The EPP's listeners and their defaults (pkg/epp/server/options.go of GIE).
EPP_PORT_FLAGS = {"--grpc-port": 9002, "--grpc-health-port": 9003, "--metrics-port": 9090}
# One thread per engine: several engines share a few cores with the control plane.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class LaunchError(RuntimeError):
    """The pod cannot be run here (the message says why); the runner reports it once."""


class Workload(StrEnum):
    ENGINE = "engine"
    ENGINE_NODE = "engine-node"  # quire-engine serve --headless: tensor-parallel ranks only
    EPP = "epp"
    DOWNLOAD = "download"  # the model cache's download Job: runs to completion


# The command of the model cache's download Job (quire_operator/builders/model_cache.py).
DOWNLOAD_COMMAND = ["python", "-m", "quire_engine.hub_cache"]
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"


LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # set by the LeaderWorkerSet pod webhook


@dataclass(frozen=True)
class Launch:
    workload: Workload
    argv: list[str]
    env: dict[str, str]
    ip: str  # the pod's IP
    port: int  # the port it serves on: the engine's HTTP port, the EPP's ext_proc gRPC port
    ports: dict[int, int] = field(default_factory=dict)  # container port -> port bound
    metrics_port: int | None = None  # where its Prometheus metrics are (HTTP, /metrics)
    container: str = ""  # the container's name
    termination_log: Path | None = None  # a Job's container: its terminationMessagePath here


def workload_of(container: dict[str, Any]) -> Workload | None:
    """Which program a container is, from its command or image; None: not one run here."""
    command = [PurePosixPath(part).name for part in container.get("command") or []]
    # The image's last path component without tag or digest: "registry:5000/x/epp:v1" -> "epp".
    image = str(container.get("image", "")).split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    if command[:1] == ["quire-engine"]:
        return Workload.ENGINE
    if command[:3] == DOWNLOAD_COMMAND:
        return Workload.DOWNLOAD
    if command[:1] == ["epp"] or image == "epp":
        return Workload.EPP
    return None


def plan(
    pod: dict[str, Any],
    api: Api,
    *,
    files_dir: Path,
    epp_binary: Path | None,
    server: str,
    ca_data: str,
) -> Launch | None:
    """The process to run for ``pod``; None when none of its containers is run here.

    ``server`` and ``ca_data`` (base64 PEM) go into the EPP's kubeconfig. Raises LaunchError.
    """
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        raise LaunchError("the pod is Running but has no status.podIP yet")
    for container in pod["spec"].get("containers", []):
        workload = workload_of(container)
        if workload is None:
            continue
        env = _resolve_env(pod, container, api)
        if LEADER_ADDRESS_ENV in env:
            env[LEADER_ADDRESS_ENV] = _pod_dns_ip(env[LEADER_ADDRESS_ENV], api)
        args = _expand([*container.get("command", [])[1:], *container.get("args", [])], env)
        mounted = _materialize_volumes(pod, container, api, files_dir)
        parents = _mount_parents(mounted, files_dir / "root")
        if workload is Workload.DOWNLOAD:
            log = files_dir / "termination-log"
            log.touch()
            path = container.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
            mounted[path] = log
            args = _rewrite_paths(args, mounted, parents)
            env = {name: _rewrite_paths([value], mounted)[0] for name, value in env.items()}
            # args are "-m quire_engine.hub_cache ...": this interpreter runs the module.
            argv = [sys.executable, *args]
            return Launch(
                workload, argv, env, ip, 0, container=container["name"], termination_log=log
            )
        args = _rewrite_paths(args, mounted, parents)
        if workload is Workload.ENGINE:
            port = int(_flag(args, "--port") or _container_port(container) or ENGINE_PORT)
            args = _set_flags(args, {"--host": ip, "--port": str(port)})
            argv = [sys.executable, "-m", "quire_engine.cli", *args]
            if pod["spec"].get("initContainers"):
                argv = _after_init(pod, api, files_dir, argv)
            if "--headless" in args:  # a worker node's ranks: no HTTP, no metrics
                workload = Workload.ENGINE_NODE
                return Launch(workload, argv, {**ENGINE_ENV, **env}, ip, port, {port: port})
            return Launch(workload, argv, {**ENGINE_ENV, **env}, ip, port, {port: port}, port)
        if epp_binary is None:
            raise LaunchError("an Endpoint Picker pod, but the routing add-on is not built")
        ports: dict[int, int] = {}  # container port -> a free one
        replaced: dict[str, str] = {}
        for flag, default in EPP_PORT_FLAGS.items():
            container_port = int(_flag(args, flag) or default)
            ports[container_port] = free_port()
            replaced[flag] = str(ports[container_port])
        args = _set_flags(args, replaced)
        kubeconfig = files_dir / "kubeconfig"
        kubeconfig.write_text(_kubeconfig(pod, api, server, ca_data))
        kubeconfig.chmod(0o600)
        grpc = int(replaced["--grpc-port"])
        return Launch(
            workload, [str(epp_binary), *args], {**env, "KUBECONFIG": str(kubeconfig)}, ip, grpc,
            ports, int(replaced["--metrics-port"]),
        )  # fmt: skip
    return None


def _after_init(pod: dict[str, Any], api: Api, files_dir: Path, argv: list[str]) -> list[str]:
    """``argv`` run after the pod's init containers (``init_chain``), each planned as a kubelet
    would: its own env and volume mounts, paths pointed at the pod's local volumes."""
    inits = []
    for init in pod["spec"]["initContainers"]:
        command = [PurePosixPath(part).name for part in init.get("command") or []]
        if command[:2] != ["hf", "download"]:
            raise LaunchError(f"init container {init['name']}: not one this runner runs")
        env = _resolve_env(pod, init, api)
        mounted = _materialize_volumes(pod, init, api, files_dir)
        args = _rewrite_paths(_expand([*init["command"][1:], *init.get("args", [])], env), mounted)
        env = {name: _rewrite_paths([value], mounted)[0] for name, value in env.items()}
        hf = str(Path(sys.executable).parent / "hf")
        inits.append({"name": init["name"], "argv": [hf, *args], "env": env})
    plan_file = files_dir / "init-containers.json"
    plan_file.write_text(json.dumps(inits, indent=1))
    chain = Path(__file__).with_name("init_chain.py")  # stdlib only: runs as a script
    return [sys.executable, str(chain), str(plan_file), "--", *argv]


# -- arguments ---------------------------------------------------------------------------------


def _flag(args: list[str], flag: str) -> str | None:
    """The value of ``--flag value`` or ``--flag=value`` (the last one wins, as in pflag)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def _set_flags(args: list[str], values: dict[str, str]) -> list[str]:
    """Every occurrence of each flag set to its value; flags not present are appended."""
    out = list(args)
    for flag, value in values.items():
        found = False
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1], found = value, True
            elif arg.startswith(f"{flag}="):
                out[i], found = f"{flag}={value}", True
        if not found:
            out += [flag, value]
    return out


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion: defined variables replaced, ``$$`` -> ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, arg) for arg in args]


def _container_port(container: dict[str, Any]) -> int | None:
    ports = container.get("ports") or []
    return int(ports[0]["containerPort"]) if ports else None


# -- environment and volumes -------------------------------------------------------------------


def _get(api: Api, path: str) -> dict[str, Any]:
    status, reply = api("GET", path, None)
    if status != 200:
        raise LaunchError(f"GET {path}: {status} {reply}")
    result: dict[str, Any] = reply
    return result


def _data(obj: dict[str, Any]) -> dict[str, bytes]:
    """A ConfigMap's or Secret's keys as bytes (Secrets and binaryData are base64)."""
    if obj.get("kind") == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    return data


def _resolve_env(pod: dict[str, Any], container: dict[str, Any], api: Api) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": namespace,
        "metadata.uid": pod["metadata"].get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
        "status.podIP": pod.get("status", {}).get("podIP", ""),
    }
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = _expand([item.get("value", "")], env)[0]
        elif "fieldRef" in source:
            env[item["name"]] = fields.get(source["fieldRef"]["fieldPath"], "")
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configmaps" if "configMapKeyRef" in source else "secrets"
            ref = source.get("configMapKeyRef") or source["secretKeyRef"]
            status, obj = api("GET", f"/api/v1/namespaces/{namespace}/{kind}/{ref['name']}", None)
            value = _data(obj).get(ref["key"]) if status == 200 else None
            if value is None and not ref.get("optional"):
                raise LaunchError(f"env {item['name']}: {kind[:-1]} {ref['name']}/{ref['key']}")
            if value is not None:
                env[item["name"]] = value.decode()
    return env


def _pod_dns_ip(name: str, api: Api) -> str:
    """``<pod>.<subdomain>.<namespace>[.svc...]`` -> the pod's IP (what cluster DNS answers for a
    pod with ``hostname``/``subdomain`` behind a headless Service)."""
    parts = name.split(".")
    if len(parts) < 3:
        raise LaunchError(f"{LEADER_ADDRESS_ENV}={name!r} is not <pod>.<subdomain>.<namespace>")
    pod = _get(api, f"/api/v1/namespaces/{parts[2]}/pods/{parts[0]}")
    ip: str = pod.get("status", {}).get("podIP", "")
    if not ip:
        raise LaunchError(f"{LEADER_ADDRESS_ENV}: pod {parts[0]} has no IP yet")
    return ip


def _materialize_volumes(
    pod: dict[str, Any], container: dict[str, Any], api: Api, files_dir: Path
) -> dict[str, Path]:
    """Write the container's ConfigMap/Secret volumes, make its emptyDirs, find its claims'
    volumes; returns mountPath -> local directory."""
    namespace = pod["metadata"]["namespace"]
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes") or []}
    mounted: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"], {})
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            mounted[mount["mountPath"].rstrip("/")] = _claim_directory(api, namespace, claim)
            continue
        if "emptyDir" in volume:
            local = files_dir / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            mounted[mount["mountPath"].rstrip("/")] = local
            continue
        source = volume.get("configMap") or volume.get("secret")
        if source is None:
            continue  # nothing else the processes here read
        kind = "configmaps" if "configMap" in volume else "secrets"
        name = source.get("name") or source["secretName"]
        data = _data(_get(api, f"/api/v1/namespaces/{namespace}/{kind}/{name}"))
        items = source.get("items") or [{"key": key, "path": key} for key in data]
        local = files_dir / "volumes" / mount["name"]
        for item in items:
            target = local / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[item["key"]])
        sub = mount.get("subPath")
        mounted[mount["mountPath"].rstrip("/")] = local / sub if sub else local
    return mounted


def _mount_parents(mounted: dict[str, Path], root: Path) -> dict[str, Path]:
    """Each directory above a mount that is not under one itself (``/adapters``, not ``/``) ->
    a local directory under ``root`` where the mounts below it are symbolic links."""
    parents: dict[str, Path] = {}
    for mount_path, local in mounted.items():
        path = PurePosixPath(mount_path)
        if any(str(above) in mounted for above in path.parents):
            continue  # under another mount: found through it
        link = root / path.relative_to("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(local)
        for above in path.parents:
            if str(above) != "/":
                parents[str(above)] = root / above.relative_to("/")
    return parents


def _claim_directory(api: Api, namespace: str, claim: str) -> Path:
    """The local directory of the PersistentVolume bound to ``claim``."""
    found = _get(api, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
    volume_name = found.get("spec", {}).get("volumeName")
    if not volume_name or found.get("status", {}).get("phase") != "Bound":
        raise LaunchError(f"PersistentVolumeClaim {claim} is not bound yet")
    volume = _get(api, f"/api/v1/persistentvolumes/{volume_name}")["spec"]
    source = volume.get("hostPath") or volume.get("local")
    if source is None:
        raise LaunchError(f"PersistentVolume {volume_name} is neither hostPath nor local")
    return Path(source["path"])


def _rewrite_paths(
    args: list[str], mounted: dict[str, Path], parents: dict[str, Path] | None = None
) -> list[str]:
    """Point arguments (or ``--flag=`` values) under a mountPath at the local copy, and those
    naming exactly a directory above mounts (``_mount_parents``) at its local tree."""

    def local(value: str) -> str:
        for mount_path, directory in sorted(mounted.items(), key=lambda m: -len(m[0])):
            if value == mount_path or value.startswith(f"{mount_path}/"):
                return str(directory) + value[len(mount_path) :]
        found = (parents or {}).get(value.rstrip("/"))
        return value if found is None else str(found)

    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        out.append(f"{flag}={local(value)}" if eq and flag.startswith("-") else local(arg))
    return out


def _kubeconfig(pod: dict[str, Any], api: Api, server: str, ca_data: str) -> str:
    """The pod's ServiceAccount credentials, as the in-cluster config would give them."""
    spec, meta = pod["spec"], pod["metadata"]
    account = spec.get("serviceAccountName") or "default"
    user: dict[str, str] = {}
    if spec.get("automountServiceAccountToken", True):
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            # Bound to the pod: the token dies with it, like a projected service-account token.
            "spec": {
                "expirationSeconds": 86400,
                "boundObjectRef": {
                    "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
                },
            },
        }  # fmt: skip
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        status, reply = api("POST", path, request)
        if status != 201:
            raise LaunchError(f"TokenRequest for ServiceAccount {account}: {status} {reply}")
        user = {"token": reply["status"]["token"]}
    cluster = {"server": server, "certificate-authority-data": ca_data}
    context = {"cluster": "cluster", "user": account, "namespace": meta["namespace"]}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "cluster", "cluster": cluster}],
        "users": [{"name": account, "user": user}],
        "contexts": [{"name": "pod", "context": context}],
        "current-context": "pod",
    }
    return json.dumps(config, indent=2) + "\n"
