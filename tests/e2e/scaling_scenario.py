"""One autoscaling scenario end to end: an InferenceService, its engines, load, and the chain
Prometheus -> (KEDA | prometheus-adapter) -> HPA controller -> Deployment -> pod runner.

Nothing here decides a replica count: this module creates the InferenceService, drives load and
reads what the real components did (HPA status, Deployment, metrics APIs, Prometheus). Every wait
is a poll with a deadline; every milestone goes into a ``Timeline`` that the test logs.

Ownership: a ``Scenario`` owns its pod runner, its load and its replica-ownership watcher, and
stops them in ``close``; the InferenceService lives in the test's namespace, which the
``namespace`` fixture deletes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes.client.exceptions import ApiException

from tests.cluster.addons import AutoscalingStack
from tests.cluster.client import ClusterHandle
from tests.cluster.routing import RoutingStack
from tests.e2e.inference_service import GROUP, PLURAL, VERSION, tiny_inference_service
from tests.e2e.load import Load, Target
from tests.e2e.pod_runner import PodRunner
from tests.waiting import wait_until

logger = logging.getLogger("quire.e2e")
T = TypeVar("T")

OPERATOR = "quire-operator"
# Short windows so a test sees scale-in within a minute: scale up at once by one pod per
# second, scale down one pod per 2 s after 10 quiet seconds (the CRD's defaults: 10 min / 2 min).
FAST_BEHAVIOR = {
    "scaleUp": {
        "stabilizationWindowSeconds": 0,
        "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 1}],
    },
    "scaleDown": {
        "stabilizationWindowSeconds": 10,
        "selectPolicy": "Max",
        "policies": [{"type": "Pods", "value": 1, "periodSeconds": 2}],
    },
}
# Deadlines: generous, because the shared 2-core machine may be busy; a healthy run takes a
# fraction (docs/autoscaling.md shows measured timelines).
STEP_TIMEOUT_S = 240.0


class Timeline:
    """Milestones in seconds since the scenario started; the first mark of a name wins."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def mark(self, what: str) -> float:
        now = time.monotonic() - self.t0
        with self._lock:
            self.events.append((now, what))
        logger.info("[%s] +%6.1fs %s", self.name, now, what)
        return now

    def render(self) -> str:
        with self._lock:
            lines = [f"  +{t:6.1f}s  {what}" for t, what in self.events]
        return f"timeline {self.name}:\n" + "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        with self._lock:
            return {"name": self.name, "events": [[round(t, 2), w] for t, w in self.events]}


def poll(what: str, fetch: Callable[[], T], until: Callable[[T], bool], timeout_s: float) -> T:
    """``fetch()`` every 0.5 s until ``until`` holds; AssertionError with the last value."""
    return wait_until(
        fetch, timeout=timeout_s, interval=0.5, message=f"waiting for {what}", until=until
    )


@dataclass
class Scenario:
    cluster: ClusterHandle
    stack: AutoscalingStack
    namespace: str
    name: str
    backend: str  # "keda" or "hpa"
    log_dir: Path
    routing: RoutingStack | None = None  # given: routed through an InferencePool
    timeline: Timeline = field(init=False)
    runner: PodRunner = field(init=False)
    load: Load | None = None
    ownership_violations: list[str] = field(default_factory=list)
    _watching: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.timeline = Timeline(f"{self.backend}/{self.name}")
        self.runner = PodRunner(
            self.cluster.core,
            self.namespace,
            f"app.kubernetes.io/instance={self.name}",
            self.stack.targets_file,
            self.log_dir,
            on_event=self.timeline.mark,
            epp_binary=self.routing.binaries.epp if self.routing else None,
        )

    @property
    def routed(self) -> bool:
        return self.routing is not None

    # -- setup ------------------------------------------------------------------------------

    def create(
        self,
        targets: dict[str, float],
        *,
        max_num_seqs: int,
        num_blocks: int,
        max_model_len: int = 256,
        max_replicas: int = 2,
        min_replicas: int = 1,
        keda: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """The InferenceService (tiny model on CPU), then the pod runner and the watcher; waits
        for the first engine unless ``min_replicas`` is 0. ``targets`` and ``extra`` go into
        ``spec.autoscaling``, ``keda`` into its ``keda`` settings."""
        autoscaling: dict[str, Any] = {
            "enabled": True,
            "backend": self.backend,
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "behavior": FAST_BEHAVIOR,
            **targets,
            **(extra or {}),
        }
        if self.backend == "keda":
            autoscaling["keda"] = {
                "serverAddress": self.stack.prometheus_url,
                "pollingInterval": 1,
                **(keda or {}),
            }
        routing: dict[str, Any] = {"routing": {"mode": "InferencePool"}} if self.routed else {}
        body = tiny_inference_service(
            self.name,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            autoscaling=autoscaling,
            **routing,
        )
        self.cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, body
        )
        self.timeline.mark("InferenceService created")
        self.runner.start()
        self._watcher = threading.Thread(target=self._watch_replicas_owner, daemon=True)
        self._watcher.start()
        if min_replicas == 0:
            return
        poll(
            "the first engine ready",
            lambda: len(self.runner.engines()),
            lambda n: n >= 1,
            STEP_TIMEOUT_S,
        )

    def close(self) -> None:
        """Stop load, watcher and engines; idempotent (a test may close a scenario early)."""
        if self._watching.is_set():
            return
        if self.load is not None:
            self.load.stop()
        self._watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        self.runner.stop()
        logger.info("%s", self.timeline.render())

    # -- reading the chain ------------------------------------------------------------------

    @property
    def hpa_name(self) -> str:
        return f"keda-hpa-{self.name}" if self.backend == "keda" else self.name

    def inference_service(self) -> dict[str, Any]:
        body = self.cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        assert isinstance(body, dict)
        return body

    def hpa(self) -> dict[str, Any] | None:
        try:
            found = self.cluster.autoscaling.read_namespaced_horizontal_pod_autoscaler(
                self.hpa_name, self.namespace
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        hpa: dict[str, Any] = self.cluster.json(found)
        return hpa

    def desired_replicas(self) -> int:
        hpa = self.hpa()
        return int(((hpa or {}).get("status") or {}).get("desiredReplicas") or 0)

    def scaling_active(self) -> bool:
        conditions = ((self.hpa() or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "ScalingActive" and c["status"] == "True" for c in conditions)

    def deployment_replicas(self) -> int:
        deployment = self.cluster.apps.read_namespaced_deployment(self.name, self.namespace)
        return int(deployment.spec.replicas or 0)

    def metrics_api(self, metric: str) -> list[dict[str, Any]]:
        """What the HPA reads: ``kubectl get --raw`` on the external (KEDA) or custom metrics API.

        For KEDA, ``metric`` is the trigger's external metric name (``s<index>-prometheus``)."""
        if self.backend == "keda":
            path = (
                f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{self.namespace}/{metric}"
                f"?labelSelector=scaledobject.keda.sh%2Fname%3D{self.name}"
            )
        else:
            path = (
                f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{self.namespace}/pods/*/{metric}"
            )
        proc = self.cluster.kubectl("get", "--raw", path)
        if proc.returncode != 0:
            return []
        items: list[dict[str, Any]] = json.loads(proc.stdout).get("items") or []
        return items

    @property
    def matchers(self) -> str:
        """PromQL matchers for this InferenceService's pods (the operator's own)."""
        return f'namespace="{self.namespace}",pod=~"{self.name}-[a-z0-9]+-[a-z0-9]+"'

    def per_pod(self, metric: str) -> dict[str, float]:
        """Prometheus' latest value of an engine gauge per pod of this InferenceService."""
        query = f"max by (pod) ({metric}{{{self.matchers}}})"
        return {r["metric"]["pod"]: float(r["value"][1]) for r in self.stack.query(query)}

    def preemptions(self) -> float:
        query = f"sum(quire_preemptions_total{{{self.matchers}}})"
        result = self.stack.query(query)
        return float(result[0]["value"][1]) if result else 0.0

    # -- load -------------------------------------------------------------------------------

    def start_load(
        self,
        *,
        concurrency: int,
        prompt_len: int,
        max_tokens: int,
        max_requests: int = 1000,
        through: str | None = None,
    ) -> Load:
        """Closed-loop load round-robin over the ready engines, or all of it ``through`` one URL
        (a gateway)."""
        gateway = [Target(through, "gateway")] if through else None
        # Token ids straight to engines; text through a gateway, as the Endpoint Picker (GIE
        # v1.5.0) reads a completion's prompt as a string and refuses token-id prompts.
        prompt: list[int] | str = [(7 * i + 3) % 250 + 1 for i in range(prompt_len)]
        if through:
            prompt = "".join(chr(33 + (7 * i + 3) % 94) for i in range(prompt_len - 1))
        self.load = Load(
            (lambda: gateway) if gateway else self.runner.engines,
            self.name,
            concurrency,
            prompt,
            max_tokens,
            max_requests,
        )
        self.load.start()
        self.timeline.mark(f"load started ({concurrency} clients)")
        return self.load

    def stop_load(self) -> None:
        if self.load is not None:
            self.load.stop()
            self.timeline.mark(f"load stopped ({self.load.completed} requests completed)")

    # -- the common acceptance steps --------------------------------------------------------

    def expect_scale_out(self, replicas: int = 2) -> None:
        """The HPA decides, the Deployment follows, the new engine becomes ready."""
        poll("HPA desiredReplicas", self.desired_replicas, lambda n: n >= replicas, STEP_TIMEOUT_S)
        self.timeline.mark(f"scaling decision: HPA desiredReplicas >= {replicas}")
        poll("Deployment replicas", self.deployment_replicas, lambda n: n >= replicas, 30)
        self.timeline.mark(f"Deployment scaled to >= {replicas}")
        poll(
            f"{replicas} ready engines",
            lambda: len(self.runner.engines()),
            lambda n: n >= replicas,
            STEP_TIMEOUT_S,
        )
        self.timeline.mark(f"{replicas} engines ready")

    def queue_peak(self, at_least: float = 5) -> float:
        """The one engine's queue once it has built up (8 clients, 2 slots: 6 waiting); the
        second engine takes seconds to start, so the first one queues until then."""
        peak: float = poll(
            f"a queue of >= {at_least:g} on one pod",
            lambda: max(self.per_pod("quire_num_requests_waiting").values(), default=0.0),
            lambda value: value >= at_least,
            60,
        )
        self.timeline.mark(f"queue peaked at {peak:g} on one pod")
        return peak

    def expect_queue_to_fall(self, peak: float) -> None:
        """With two engines sharing the clients, the average per-pod queue drops by >= 2."""
        fell = poll(
            "per-pod queue to fall",
            lambda: self.per_pod("quire_num_requests_waiting"),
            lambda per_pod: len(per_pod) == 2 and sum(per_pod.values()) / 2 <= peak - 2,
            STEP_TIMEOUT_S,
        )
        self.timeline.mark(f"per-pod queue fell from {peak:g} to {sum(fell.values()) / 2:g}")

    def expect_scale_in_without_operator_replicas(self) -> None:
        """Load off -> back to minReplicas; the operator never owned spec.replicas meanwhile."""
        self.stop_load()
        self.expect_scale_in()
        assert self.ownership_violations == []
        assert "quire-operator/-" not in self.replicas_managers()

    def expect_scale_in(self) -> None:
        poll("Deployment back to 1 replica", self.deployment_replicas, lambda n: n == 1, 180)
        self.timeline.mark("scaled in to minReplicas (1)")
        poll(
            "one engine left",
            lambda: len(self.runner.engines(ready_only=False)),
            lambda n: n == 1,
            60,
        )

    # -- replica ownership ------------------------------------------------------------------

    def _watch_replicas_owner(self) -> None:
        """Every second: the operator's managedFields entry on the Deployment must not own
        ``spec.replicas`` (it would fight the HPA)."""
        while not self._watching.wait(1.0):
            try:
                entries = self._managed_fields()
            except ApiException:
                continue
            for entry in entries:
                if entry["manager"] == OPERATOR and "f:replicas" in _spec_fields(entry):
                    violation = f"{entry['manager']} owns spec.replicas ({entry['operation']})"
                    if violation not in self.ownership_violations:
                        self.ownership_violations.append(violation)

    def _managed_fields(self) -> list[dict[str, Any]]:
        deployment = self.cluster.apps.read_namespaced_deployment(self.name, self.namespace)
        entries: list[dict[str, Any]] = self.cluster.json(deployment)["metadata"]["managedFields"]
        return entries

    def replicas_managers(self) -> list[str]:
        """Managers (``manager/subresource``) that own the Deployment's ``spec.replicas`` now."""
        return sorted(
            f"{entry['manager']}/{entry.get('subresource') or '-'}"
            for entry in self._managed_fields()
            if "f:replicas" in _spec_fields(entry)
        )


def _spec_fields(entry: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = (entry.get("fieldsV1") or {}).get("f:spec") or {}
    return fields
