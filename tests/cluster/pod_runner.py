"""A kubelet stand-in: one real process per Running pod that kwok only pretends to run.

kwok makes pods Running without running anything. ``PodRunner`` polls the pods of one namespace
and label selector and, for each Running pod that is not being deleted, starts what its
container is (``pod_launch.plan``: a ``quire-engine`` on ``<podIP>:<port>``, or the Endpoint
Picker with its own args). It stops a pod's process when the pod goes away, tracks readiness
(the engine's ``/ready``; the EPP accepting connections on its gRPC port, which its manager opens
only once its informer caches have synced), and keeps an optional Prometheus file-SD JSON listing
every pod's metrics endpoint (engines' and pickers') with the ``namespace`` and ``pod`` labels a
PodMonitor would give its series.

A process that exits is counted in its pod's ``restartCount`` (see ``_report_exit``), as a
kubelet counts a container restart; it is not started again.

A pod of the model cache's download Job (``Workload.DOWNLOAD``) runs to completion: when its
process ends the runner writes what a kubelet would, phase ``Succeeded`` or ``Failed`` and the
container's ``terminated`` state with its exit code and termination message (the file the
program wrote; on failure with ``FallbackToLogsOnError`` and an empty file, the last lines of its
log), so the Job controller counts it. kwok's own pod-complete Stage is left out of the test
cluster (launcher.py) for this.

Readiness is reported on the pod, as a kubelet's probes do: kwok marks a pod Ready the moment it
runs, so the runner sets ``Ready``/``ContainersReady`` to False when it starts the pod's process,
True once that process is ready, and False again if it exits (a crashed container). Controllers
and the Endpoint Picker, which count only Ready pods, then see what really serves. kwok leaves the
conditions alone after that: its ready stage matches only Pending pods. Between kwok's write and
the runner's first one (a poll interval, well under a second) a pod looks Ready with nothing
behind it; a test that adds pods under load sees requests refused by such a pod in that window,
which a real kubelet, whose probes gate Ready, never shows.

Ownership: the runner owns its processes (stopped by ``stop``), the per-pod files it writes
(volumes, the EPP's kubeconfig) under ``log_dir/pods``, the targets file it rewrites (atomically,
so Prometheus never reads half of it) and its polling thread. Everything it knows is guarded by
one lock; ``processes()`` hands out copies of the list.

Stdlib only: ``api`` is ``ControlPlane.request``'s shape (see pod_launch.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .pod_launch import Api, Launch, LaunchError, Workload, plan
from .process import ManagedProcess, tail

_ENGINE_SOURCE = Path(__file__).resolve().parents[2] / "engine"


@dataclass
class PodProcess:
    """One pod's process. ``url``: the engine's base URL, or ``host:port`` of the EPP's gRPC."""

    pod: str
    workload: Workload
    ip: str
    port: int
    ports: dict[int, int]  # container port -> port bound
    process: ManagedProcess
    started: float  # time.monotonic()
    ready_at: float | None = None
    metrics_port: int | None = None  # its Prometheus /metrics (the EPP listens on every address)
    exit_reported: bool = False  # its exit counted in the pod's restartCount
    uid: str = ""  # the pod's: a StatefulSet's pod recreated under the same name is a new pod
    container: str = ""
    termination_log: Path | None = None  # a Job's pod: its termination message file
    ended: bool = False  # a Job's pod: its end is reported on the pod

    @property
    def ready(self) -> bool:
        return self.ready_at is not None

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass(frozen=True)
class ApiServer:
    """Where the EPP's kubeconfig points: the server URL and its CA (base64 PEM)."""

    server: str
    ca_data: str

    @classmethod
    def from_kubeconfig(cls, path: Path) -> ApiServer:
        cluster = json.loads(path.read_text())["clusters"][0]["cluster"]
        return cls(cluster["server"], cluster["certificate-authority-data"])


@dataclass
class PodRunner:
    api: Api
    api_server: ApiServer
    namespace: str
    selector: str
    log_dir: Path
    targets_file: Path | None = None  # Prometheus file-SD of the pods, when given
    epp_binary: Path | None = None  # the routing add-on's EPP, to run EPP pods
    on_event: Callable[[str], object] = lambda _: None
    poll_s: float = 0.3
    errors: list[str] = field(default_factory=list)
    _procs: dict[str, PodProcess] = field(default_factory=dict)
    # pod -> why its launch failed; retried every poll (as a kubelet retries a container whose
    # ConfigMap or Secret is missing), reported again only when the reason changes.
    _failed: dict[str, str] = field(default_factory=dict)
    _reported: dict[str, bool] = field(default_factory=dict)  # pod -> Ready as last written
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            procs = list(self._procs.values())
            self._procs.clear()
        for proc in procs:
            proc.process.stop()
        self._write_targets([])

    def processes(
        self, workload: Workload | None = None, *, ready_only: bool = True
    ) -> list[PodProcess]:
        """Copies of the records, oldest first; ``workload`` None: every kind."""
        with self._lock:
            found = [
                p
                for p in self._procs.values()
                if (p.ready or not ready_only) and workload in (None, p.workload)
            ]
        return sorted(found, key=lambda p: p.started)

    def engines(self, *, ready_only: bool = True) -> list[PodProcess]:
        return self.processes(Workload.ENGINE, ready_only=ready_only)

    def epps(self, *, ready_only: bool = True) -> list[PodProcess]:
        return self.processes(Workload.EPP, ready_only=ready_only)

    def report(self, lines: int = 30) -> str:
        with self._lock:
            procs = list(self._procs.values())
        return "\n".join(p.process.describe_failure(lines) for p in procs)

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as err:  # a transient API error must not end the kubelet
                self.errors.append(f"{type(err).__name__}: {err}")
            self._stop.wait(self.poll_s)

    def _list_pods(self) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"labelSelector": self.selector})
        status, reply = self.api("GET", f"/api/v1/namespaces/{self.namespace}/pods?{query}", None)
        if status != 200:
            raise LaunchError(f"listing pods: {status} {reply}")
        items: list[dict[str, Any]] = reply["items"]
        return items

    def _sync(self) -> None:
        running = {
            pod["metadata"]["name"]: pod
            for pod in self._list_pods()
            if pod.get("status", {}).get("phase") == "Running"
            and not pod["metadata"].get("deletionTimestamp")
        }
        with self._lock:
            gone = [
                name
                for name, proc in self._procs.items()
                if name not in running or running[name]["metadata"].get("uid", "") != proc.uid
            ]
            new = [name for name in running if name not in self._procs or name in gone]
        # Stop before starting: kwok gives a deleted pod's IP to the next pod, whose process
        # then binds the same address.
        for name in gone:
            with self._lock:
                proc = self._procs.pop(name)
            proc.process.stop()
            self.on_event(f"{proc.workload} of pod {name} stopped (pod gone)")
        self._failed = {name: why for name, why in self._failed.items() if name in running}
        changed = bool(gone)
        for name in new:
            try:
                self._start(running[name])
            except LaunchError as err:
                if self._failed.get(name) != str(err):
                    self.errors.append(f"pod {name}: {err}")
                self._failed[name] = str(err)
            else:
                self._failed.pop(name, None)
                changed = True
        for proc in self.processes(ready_only=False):
            if proc.workload is Workload.DOWNLOAD:
                code = proc.process.exited()
                if code is not None and not proc.ended:
                    proc.ended = self._report_ended(proc, code)
                continue
            if not proc.ready and _ready(proc):
                proc.ready_at = time.monotonic()
                self.on_event(f"{proc.workload} of pod {proc.pod} ready")
            code = proc.process.exited()
            if code is not None:
                message = f"{proc.workload} of pod {proc.pod} exited with {code}"
                if message not in self.errors:
                    self.errors.append(message)
                if not proc.exit_reported:
                    proc.exit_reported = self._report_exit(proc.pod, code)
            ready = proc.ready and code is None
            if self._reported.get(proc.pod) != ready and self._report_ready(proc.pod, ready):
                self._reported[proc.pod] = ready
        self._reported = {name: r for name, r in self._reported.items() if name in running}
        if changed:
            self._write_targets(self.processes(ready_only=False))

    def _start(self, pod: dict[str, Any]) -> None:
        name: str = pod["metadata"]["name"]
        files = self.log_dir / "pods" / name
        shutil.rmtree(files, ignore_errors=True)  # a pod of the same name before
        files.mkdir(parents=True)
        launch: Launch | None = plan(
            pod,
            self.api,
            files_dir=files,
            epp_binary=self.epp_binary,
            server=self.api_server.server,
            ca_data=self.api_server.ca_data,
        )
        if launch is None:
            raise LaunchError("no container this runner knows how to run (quire-engine, epp)")
        # Not Ready before anything runs: kwok marked the pod Ready as it started it, and until
        # this write lands a controller or the picker may count it (see the module docstring).
        # A Job's pod has no probe: it is ready while it runs, as kwok says.
        if launch.workload is not Workload.DOWNLOAD and self._report_ready(name, False):
            self._reported[name] = False
        # This checkout's engine first, whatever the interpreter has installed (an editable
        # install may point at another worktree).
        path = os.pathsep.join(filter(None, [str(_ENGINE_SOURCE), os.environ.get("PYTHONPATH")]))
        env = {**launch.env, "PYTHONPATH": path}
        log = self.log_dir / f"{launch.workload}-{name}.log"
        process = ManagedProcess(f"{launch.workload}-{name}", launch.argv, log, env=env)
        record = PodProcess(
            name, launch.workload, launch.ip, launch.port, launch.ports, process, time.monotonic(),
            metrics_port=launch.metrics_port, uid=pod["metadata"].get("uid", ""),
            container=launch.container, termination_log=launch.termination_log,
        )  # fmt: skip
        with self._lock:
            self._procs[name] = record
        self.on_event(f"{launch.workload} of pod {name} starting on {record.address}")

    def _report_ended(self, proc: PodProcess, code: int) -> bool:
        """Write a finished Job pod's phase and its container's terminated state, as a kubelet
        does; False when the write lost a race (the next poll tries again)."""
        path = f"/api/v1/namespaces/{self.namespace}/pods/{proc.pod}"
        status, pod = self.api("GET", path, None)
        if status != 200:
            return status == 404
        message = proc.termination_log.read_text() if proc.termination_log else ""
        if code and not message.strip():  # FallbackToLogsOnError: the log's tail
            message = "\n".join(tail(proc.process.log_path, 80).splitlines()[-80:])[-2048:]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        image = pod["spec"]["containers"][0].get("image", "")
        terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "message": message[:4096],
            "startedAt": now,
            "finishedAt": now,
        }
        pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
        pod["status"]["containerStatuses"] = [
            {
                "name": proc.container, "image": image, "ready": False, "restartCount": 0,
                "started": False, "state": {"terminated": terminated},
            }
        ]  # fmt: skip
        pod["status"]["conditions"] = [
            {**c, "status": "False", "reason": "PodCompleted"}
            if c["type"] in ("Ready", "ContainersReady") else c
            for c in pod["status"].get("conditions", [])
        ]  # fmt: skip
        status, _ = self.api("PUT", f"{path}/status", pod)
        if status == 200:
            self.on_event(f"{proc.workload} of pod {proc.pod} ended with {code}")
        return status in (200, 404)

    def _report_ready(self, name: str, ready: bool) -> bool:
        """Write the pod's Ready and ContainersReady conditions (and its containers' ``ready``);
        False when the write lost a race (the next poll tries again) or the pod is gone."""
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        status, pod = self.api("GET", path, None)
        if status != 200:
            return status == 404
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        value = "True" if ready else "False"
        conditions = [
            c for c in pod["status"].get("conditions", [])
            if c["type"] not in ("Ready", "ContainersReady")
        ]  # fmt: skip
        for kind in ("Ready", "ContainersReady"):
            condition = {"type": kind, "status": value, "lastTransitionTime": now}
            if not ready:
                condition["reason"] = "ContainersNotReady"
            conditions.append(condition)
        pod["status"]["conditions"] = conditions
        for container in pod["status"].get("containerStatuses", []):
            container["ready"] = ready
        status, _ = self.api("PUT", f"{path}/status", pod)
        if status == 200:
            self.on_event(f"pod {name} reported {'ready' if ready else 'not ready'}")
        return status in (200, 404)

    def _report_exit(self, name: str, code: int) -> bool:
        """Count the exit in the pod's containers' ``restartCount`` with the exit code as their
        ``lastState``, as a kubelet does before restarting a container (a LeaderWorkerSet with
        RecreateGroupOnPodRestart recreates the group on that count). The process itself is not
        restarted here. False when the write lost a race (the next poll tries again)."""
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        status, pod = self.api("GET", path, None)
        if status != 200:
            return status == 404
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        terminated = {"exitCode": code, "reason": "Error" if code else "Completed"}
        for container in pod["status"].get("containerStatuses", []):
            container["restartCount"] = int(container.get("restartCount", 0)) + 1
            container["lastState"] = {"terminated": {**terminated, "finishedAt": now}}
        status, _ = self.api("PUT", f"{path}/status", pod)
        if status == 200:
            self.on_event(f"pod {name}: exit {code} counted as a container restart")
        return status in (200, 404)

    def _write_targets(self, procs: list[PodProcess]) -> None:
        """Every pod's metrics endpoint (engines and pickers, as the chart's PodMonitors scrape
        both), labelled as a PodMonitor labels its series."""
        if self.targets_file is None:
            return
        groups = [
            {
                "targets": [f"{p.ip}:{p.metrics_port}"],
                "labels": {"namespace": self.namespace, "pod": p.pod},
            }
            for p in procs
            if p.metrics_port is not None
        ]
        scratch = self.targets_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups, indent=2) + "\n")
        scratch.replace(self.targets_file)


def _ready(proc: PodProcess) -> bool:
    if proc.workload is Workload.ENGINE_NODE:  # no probes: ready once it runs
        return proc.process.exited() is None
    if proc.workload is Workload.EPP:
        try:
            with socket.create_connection((proc.ip, proc.port), timeout=1):
                return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(f"{proc.url}/ready", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
