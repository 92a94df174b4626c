"""A kubelet stand-in for the autoscaling tests: one real ``quire-engine serve`` per Running pod.

kwok makes pods Running without running anything. ``PodRunner`` polls the pods of one
InferenceService and, for each Running pod that is not being deleted, starts the engine with the
pod's own container arguments (so the operator's flags are what runs), except ``--host`` and
``--port``: each engine binds 127.0.0.1 on a free port. It stops an engine when its pod goes away
and keeps a Prometheus file-SD JSON listing every engine with the ``namespace`` and ``pod``
labels a PodMonitor would give its series.

Ownership: the runner owns its engine processes (stopped by ``stop``), the targets file it
rewrites (atomically, so Prometheus never reads half of it) and its polling thread. Everything it
knows is guarded by one lock; ``engines()`` hands out copies.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.cluster.process import ManagedProcess, free_port


@dataclass
class Engine:
    pod: str
    url: str
    process: ManagedProcess
    started: float  # time.monotonic()
    ready_at: float | None = None

    @property
    def ready(self) -> bool:
        return self.ready_at is not None


def engine_argv(container_args: list[str], port: int) -> list[str]:
    """The pod's ``quire-engine`` arguments with the address replaced by 127.0.0.1:port."""
    args = list(container_args)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return [sys.executable, "-m", "quire_engine.cli", *args]


@dataclass
class PodRunner:
    core: client.CoreV1Api
    namespace: str
    selector: str
    targets_file: Path
    log_dir: Path
    on_event: Callable[[str], object] = lambda _: None
    poll_s: float = 0.3
    _engines: dict[str, Engine] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    errors: list[str] = field(default_factory=list)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            engines = list(self._engines.values())
            self._engines.clear()
        for engine in engines:
            engine.process.stop()
        self._write_targets([])

    def engines(self, *, ready_only: bool = True) -> list[Engine]:
        with self._lock:
            found = [e for e in self._engines.values() if e.ready or not ready_only]
        return sorted(found, key=lambda e: e.started)

    def report(self, lines: int = 30) -> str:
        with self._lock:
            engines = list(self._engines.values())
        return "\n".join(e.process.describe_failure(lines) for e in engines)

    # -- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as err:  # a transient API error must not end the kubelet
                self.errors.append(f"{type(err).__name__}: {err}")
            self._stop.wait(self.poll_s)

    def _sync(self) -> None:
        listed = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        pods: list[dict[str, Any]] = self.core.api_client.sanitize_for_serialization(listed)[
            "items"
        ]
        running = {
            pod["metadata"]["name"]: pod
            for pod in pods
            if pod.get("status", {}).get("phase") == "Running"
            and not pod["metadata"].get("deletionTimestamp")
        }
        with self._lock:
            gone = [name for name in self._engines if name not in running]
            new = [name for name in running if name not in self._engines]
        for name in gone:
            with self._lock:
                engine = self._engines.pop(name)
            engine.process.stop()
            self.on_event(f"engine of pod {name} stopped (pod gone)")
        for name in new:
            self._start_engine(running[name])
        for engine in self.engines(ready_only=False):
            if not engine.ready and _ready(engine.url):
                engine.ready_at = time.monotonic()
                self.on_event(f"engine of pod {engine.pod} ready")
            code = engine.process.exited()
            if code is not None:
                message = f"engine of pod {engine.pod} exited with {code}"
                if message not in self.errors:
                    self.errors.append(message)
        if gone or new:
            self._write_targets(self.engines(ready_only=False))

    def _start_engine(self, pod: dict[str, Any]) -> None:
        name: str = pod["metadata"]["name"]
        port = free_port()
        argv = engine_argv(list(pod["spec"]["containers"][0].get("args") or []), port)
        # One thread per engine: several engines share two cores with the control plane.
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        process = ManagedProcess(
            f"engine-{name}",
            argv,
            self.log_dir / f"engine-{name}.log",
            env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        engine = Engine(name, f"http://127.0.0.1:{port}", process, time.monotonic())
        with self._lock:
            self._engines[name] = engine
        self.on_event(f"engine of pod {name} starting on {engine.url}")

    def _write_targets(self, engines: list[Engine]) -> None:
        groups = [
            {
                "targets": [engine.url.removeprefix("http://")],
                "labels": {"namespace": self.namespace, "pod": engine.pod},
            }
            for engine in engines
        ]
        scratch = self.targets_file.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups, indent=2) + "\n")
        scratch.replace(self.targets_file)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
