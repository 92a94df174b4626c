"""One routed fleet end to end: an InferenceService with ``spec.routing.mode: InferencePool``, the
operator's InferencePool and Endpoint Picker, real engines and a real picker run for their pods,
and Envoy in front: as the Gateway (ext_proc to the picker, GIE's configuration) and as the plain
Service (random over the engines, what kube-proxy does).

Nothing here picks a replica: the picker does, from the engines' own ``/metrics`` and the
operator's configuration. Tests read what happened from the engines' counters and Envoy's access
log (one line per request, with the client's ``x-request-id`` and the upstream that served it).

Ownership: a ``RoutedFleet`` owns its pod runner (engines and picker) and its Envoys, and stops
them in ``close``; the InferenceService lives in the test's namespace, which the ``namespace``
fixture deletes.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.client import ClusterHandle
from tests.cluster.gateway import FailureMode, Gateway, GatewayConfig, ServiceConfig
from tests.cluster.pod_runner import PodProcess, PodRunner
from tests.cluster.routing import RoutingStack
from tests.e2e.inference_service import GROUP, PLURAL, VERSION, tiny_inference_service
from tests.waiting import wait_until

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
# Engines load on a shared 2-core machine next to a control plane; a healthy start takes seconds.
TIMEOUT_S = 240.0


class AccessLine(NamedTuple):
    """One request as Envoy logged it."""

    status: int
    upstream: str  # "podIP:port", or "-" when no upstream was reached
    request_id: str


@dataclass
class RoutedFleet:
    cluster: ClusterHandle
    routing: RoutingStack
    namespace: str
    name: str
    runner: PodRunner = field(init=False)
    gateways: list[Gateway] = field(default_factory=list)

    def create(
        self,
        replicas: int,
        *,
        num_blocks: int,
        max_num_seqs: int,
        routing: dict[str, Any] | None = None,
        engine: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """The InferenceService, then the kubelet stand-in for its engine and picker pods; returns
        once ``replicas`` engines and the picker serve. ``engine``: more spec.engine fields;
        ``lora``: spec.lora (the operator loads its adapters once the engines are ready)."""
        body = tiny_inference_service(
            self.name,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=512,
            engine=engine,
            replicas=replicas,
            routing={"mode": "InferencePool", **(routing or {})},
            **({"lora": lora} if lora is not None else {}),
        )
        self.cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, body
        )
        self.runner = self.routing.pod_runner(
            self.namespace, f"app.kubernetes.io/instance={self.name}"
        )
        self.wait_engines(replicas)
        self.epp()

    def close(self) -> None:
        """Stop what runs (again: a no-op); the InferenceService stays, in its namespace."""
        for gateway in self.gateways:
            gateway.stop()
        self.gateways.clear()
        if hasattr(self, "runner"):
            self.runner.stop()
            del self.runner

    # -- what runs --------------------------------------------------------------------------

    def wait_engines(self, count: int) -> list[PodProcess]:
        return wait_until(
            lambda: self.runner.engines() if len(self.runner.engines()) >= count else None,
            timeout=TIMEOUT_S,
            interval=0.3,
            message=lambda: f"{count} engines ready\n{self.runner.errors}\n{self.runner.report()}",
        )

    def epp(self) -> PodProcess:
        """The picker's process once it accepts ext_proc connections (caches synced)."""
        return wait_until(
            lambda: next(iter(self.runner.epps()), None),
            timeout=TIMEOUT_S,
            interval=0.3,
            message=lambda: f"the endpoint picker serving\n{self.runner.errors}",
        )

    def engine_at(self, address: str) -> PodProcess:
        (engine,) = [e for e in self.runner.engines(ready_only=False) if e.address == address]
        return engine

    def inference_service(self) -> dict[str, Any]:
        body = self.cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.name
        )
        assert isinstance(body, dict)
        return body

    def inference_pool(self) -> dict[str, Any]:
        pool = self.cluster.custom.get_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL, self.name
        )
        assert isinstance(pool, dict)
        return pool

    # -- the two data paths -----------------------------------------------------------------

    def gateway(self, fallback: str | None = None) -> Gateway:
        """Envoy as a Gateway routing to the pool: ext_proc to the picker, failing as the
        InferencePool says (its ``endpointPickerRef.failureMode``, which the operator wrote)."""
        mode = FailureMode(self.inference_pool()["spec"]["endpointPickerRef"]["failureMode"])
        config = GatewayConfig(
            epp=self.epp().address,
            failure_mode=mode,
            fallback=fallback if mode is FailureMode.FAIL_OPEN else None,
        )
        gateway = self.routing.gateway(config)
        self.gateways.append(gateway)
        return gateway

    def service(self) -> Gateway:
        """Envoy as the plain Service over the engines ready now."""
        endpoints = tuple(e.address for e in self.runner.engines())
        gateway = self.routing.gateway(ServiceConfig(endpoints))
        self.gateways.append(gateway)
        return gateway

    # -- faults -----------------------------------------------------------------------------

    def kill_engine(self, engine: PodProcess) -> None:
        """The replica dies: its process is SIGKILLed (requests in flight on it are cut); the
        kubelet stand-in then reports the pod not Ready, as a kubelet does for a dead container,
        and the picker drops the endpoint."""
        os.kill(engine.process.pid, signal.SIGKILL)

    def kill_epp(self) -> PodProcess:
        """The picker crashes (SIGKILL); its pod stays, as a kubelet's would until it restarts."""
        epp = self.epp()
        os.kill(epp.process.pid, signal.SIGKILL)
        return epp


def client(gateway: Gateway, timeout: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )


def first_answer(gateway: Gateway, model: str) -> None:
    """The picker routes once it has listed the pool's pods and scraped them."""
    wait_until(
        lambda: client(gateway, 30).completions.create(model=model, prompt="hi", max_tokens=1),
        timeout=120,
        interval=0.5,
        message=lambda: "a completion through the gateway\n" + "\n".join(gateway.access_log()[-5:]),
        ignore=(openai.APIStatusError, openai.APIConnectionError),
    )


def access_log(
    gateway: Gateway, ids: Collection[str] = (), at_least: int = 0, timeout: float = 60.0
) -> list[AccessLine]:
    """Envoy's access log, once it holds a line for every request id in ``ids`` and at least
    ``at_least`` lines. Envoy writes a line after the response has gone out and flushes the file
    on a timer, so a client that has its answer may read the log before that line is there."""

    def settled() -> list[AccessLine] | None:
        lines = _parse(gateway.access_log())
        logged = {line.request_id for line in lines}
        return lines if len(lines) >= at_least and logged.issuperset(ids) else None

    return wait_until(
        settled,
        timeout=timeout,
        interval=0.1,
        message=lambda: f"{len(ids)} request ids and {at_least} lines in the access log",
    )


def _parse(raw: list[str]) -> list[AccessLine]:
    lines = []
    for line in raw:
        status = line.split("] ", 1)[1].split()[2]
        upstream = line.split(" upstream=")[1].split()[0]
        request_id = line.split(" id=")[1].split()[0]
        lines.append(AccessLine(int(status), upstream, request_id))
    return lines


def engine_metrics(engine: PodProcess) -> dict[str, float]:
    """Each series of the engine's ``/metrics`` summed over its labels."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def engine_series(engine: PodProcess, sample: str, label: str) -> dict[str, float]:
    """The engine's ``sample`` by the value of its ``label`` (summed over its other labels)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample:
                values[s.labels[label]] = values.get(s.labels[label], 0.0) + s.value
    return values


def served(engine: PodProcess) -> float:
    """Requests the engine finished, every reason."""
    return engine_metrics(engine).get("quire_request_success_total", 0.0)


def save_report(name: str, report: dict[str, Any]) -> None:
    """Append ``report`` to ``$QUIRE_E2E_TIMELINES`` (JSON lines) when set, as the autoscaling
    timelines are: docs/routing.md's figures come from there."""
    target = os.environ.get("QUIRE_E2E_TIMELINES")
    if target:
        with Path(target).open("a") as out:
            out.write(json.dumps({"name": name, "report": report}) + "\n")
