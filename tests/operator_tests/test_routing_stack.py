"""The test cluster's routing path, end to end with real parts: Gateway API Inference Extension's
CRDs, kwok pods on unique loopback IPs, real tiny engines bound to those IPs, the real Endpoint
Picker (GIE v1.5.0's ``cmd/epp``) run as its pod with the pod's own args and ServiceAccount, and
Envoy with GIE's ext_proc + original-destination configuration.

Nothing decides a route here but the EPP: tests read the EPP's pick from Envoy's access log (the
``x-gateway-destination-endpoint`` header it set and the upstream Envoy connected to) and check it
against the engines' own request counters.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.client import ClusterHandle, wait_for
from tests.cluster.gateway import FailureMode, Gateway, GatewayConfig
from tests.cluster.pod_runner import PodProcess, PodRunner
from tests.cluster.routing import RoutingStack
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
ENGINE_LABELS = {"app": "tiny-engine", "stack": "routing"}
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"  # kwok pulls nothing
# The EPP's plugins as GIE's chart configures them: queue depth, KV-cache utilization and
# prefix-cache scorers, metrics scraped from each engine's /metrics.
EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: http
    path: /metrics
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""
# What GIE's chart grants its EPP's ServiceAccount (config/charts/epplib and inferencepool).
EPP_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]},
    {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"], "verbs": ["get", "watch", "list"]},
    {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": ["get", "watch", "list"],
    },
]
TIMEOUT_S = 180.0  # engines load on a shared 2-core machine; a healthy run takes seconds


def inference_pool(name: str, *, target_ports: list[int] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{POOL_GROUP}/{POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "targetPorts": [{"number": port} for port in target_ports or [8000]],
            "selector": {"matchLabels": {"app": ENGINE_LABELS["app"]}},
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


def engine_pod(name: str) -> dict[str, Any]:
    args = [
        "serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000",
        "--num-blocks", "64", "--max-model-len", "256", "--device", "cpu",
        "--log-format", "json",
    ]  # fmt: skip
    container = {
        "name": "engine",
        "image": "quire.invalid/engine:test",
        "command": ["quire-engine"],
        "args": args,
        "ports": [{"name": "http", "containerPort": 8000}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": ENGINE_LABELS},
        "spec": {"containers": [container], "automountServiceAccountToken": False},
    }


def epp_pod(name: str, pool: str, namespace: str) -> dict[str, Any]:
    """Shaped like GIE's chart: its args, config file from a ConfigMap, own ServiceAccount."""
    args = [
        "--pool-name", pool, "--pool-namespace", namespace,
        "--pool-group", POOL_GROUP, "--config-file", "/config/default-plugins.yaml",
        "--tracing=false", "--metrics-endpoint-auth=false",
        # Scrape and flush often so the pick follows the engines' state within a test.
        "--refresh-metrics-interval", "50ms",
    ]  # fmt: skip
    container = {
        "name": "epp",
        "image": EPP_IMAGE,
        "args": args,
        "ports": [
            {"name": "grpc", "containerPort": 9002},
            {"name": "metrics", "containerPort": 9090},
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "volumeMounts": [{"name": "config", "mountPath": "/config"}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "tiny-epp", "stack": "routing"}},
        "spec": {
            "serviceAccountName": "epp",
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": "epp-config"}}],
        },
    }


@dataclass
class Pool:
    """Two engine pods behind an InferencePool, run by a kubelet stand-in."""

    cluster: ClusterHandle
    routing: RoutingStack
    namespace: str
    name: str
    runner: PodRunner

    def start_epp(self, name: str) -> PodProcess:
        self.cluster.core.create_namespaced_pod(
            self.namespace,
            epp_pod(name, self.name, self.namespace),  # type: ignore[arg-type]  # dict body: the client validates it
        )

        def serving() -> PodProcess | None:
            found = next((p for p in self.runner.epps() if p.pod == name), None)
            if found is None:
                alive(self.runner)  # raises once a process exited
            return found

        return wait_until(
            serving,
            timeout=TIMEOUT_S,
            interval=0.2,
            message=lambda: f"EPP pod {name} serving\n{self.runner.errors}\n{self.runner.report()}",
        )

    def gateway(self, epp: PodProcess, **settings: Any) -> Gateway:
        return self.routing.gateway(GatewayConfig(epp=epp.address, **settings))

    def engine_at(self, address: str) -> PodProcess:
        (engine,) = [e for e in self.runner.engines() if e.address == address]
        return engine


def served(engine: PodProcess) -> float:
    """Requests the engine finished (``quire_request_success_total``, all reasons)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "quire_request_success_total"
    )


def complete(gateway: Gateway, prompt: str = "Hello") -> openai.types.Completion:
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30
    )
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=4)


def first_answer(gateway: Gateway) -> openai.types.Completion:
    """The first 200 through ``gateway``: the EPP routes once it has listed the pool's pods."""
    return wait_until(
        lambda: complete(gateway),
        timeout=TIMEOUT_S,
        interval=0.5,
        message=lambda: "a completion through the gateway\n" + "\n".join(gateway.access_log()[-5:]),
        ignore=(openai.APIStatusError, openai.APIConnectionError),
    )


def alive(runner: PodRunner) -> bool:
    """False while nothing failed; raises (ending a wait at once) when a process exited."""
    assert not runner.errors, f"{runner.errors}\n{runner.report()}"
    return False


@pytest.fixture(scope="module")
def pool(cluster: ClusterHandle, routing: RoutingStack) -> Iterator[Pool]:
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    core = cluster.core
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    try:
        core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="epp"))
        )
        authz = client.RbacAuthorizationV1Api(cluster.api)
        authz.create_namespaced_role(namespace, {"metadata": {"name": "epp"}, "rules": EPP_RULES})  # type: ignore[arg-type]  # dict body: the client validates it
        authz.create_namespaced_role_binding(namespace, {  # type: ignore[arg-type]  # dict body: the client validates it
            "metadata": {"name": "epp"},
            "subjects": [{"kind": "ServiceAccount", "name": "epp", "namespace": namespace}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "epp"},
        })  # fmt: skip
        core.create_namespaced_config_map(
            namespace,
            client.V1ConfigMap(
                metadata=client.V1ObjectMeta(name="epp-config"),
                data={"default-plugins.yaml": EPP_CONFIG},
            ),
        )
        cluster.custom.create_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL, inference_pool("tiny")
        )
        for index in range(2):
            core.create_namespaced_pod(namespace, engine_pod(f"engine-{index}"))  # type: ignore[arg-type]  # dict body: the client validates it
        runner = routing.pod_runner(namespace, "stack=routing")
        wait_until(
            lambda: len(runner.engines()) == 2 or alive(runner),
            timeout=TIMEOUT_S,
            interval=0.2,
            message="two engines ready on their pod IPs",
            until=lambda done: done is True,
        )
        yield Pool(cluster, routing, namespace, "tiny", runner)
        runner.stop()  # the engines go now, not when the package's routing stack stops
    finally:
        with contextlib.suppress(Exception):
            core.delete_namespace(namespace)


def test_the_gie_crds_install_and_an_inference_pool_is_accepted(
    cluster: ClusterHandle, routing: RoutingStack, namespace: str
) -> None:
    created = cluster.json(
        cluster.custom.create_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL, inference_pool("pool")
        )
    )
    stored = created["spec"]
    assert stored["targetPorts"] == [{"number": 8000}]
    assert stored["selector"] == {"matchLabels": {"app": "tiny-engine"}}
    # The CRD's defaults: a Service in the core group, failing closed.
    ref = stored["endpointPickerRef"]
    assert (ref["kind"], ref["group"], ref["failureMode"]) == ("Service", "", "FailClose")

    with pytest.raises(ApiException) as refused:
        cluster.custom.create_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL,
            inference_pool("twice", target_ports=[8000, 8000]),
        )  # fmt: skip
    assert refused.value.status == 422
    assert "port number must be unique" in str(refused.value.body)


def test_kwok_pods_get_unique_loopback_ips_a_process_can_bind(
    cluster: ClusterHandle, namespace: str
) -> None:
    pods = [engine_pod(f"p-{index}") for index in range(3)]
    for pod in pods:
        pod["metadata"]["labels"] = {"app": "loopback"}  # not run by any pod runner
        cluster.core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]  # dict body: the client validates it

    def ips() -> list[str]:
        listed = cluster.json(
            cluster.core.list_namespaced_pod(namespace, label_selector="app=loopback")
        )
        return [p.get("status", {}).get("podIP", "") for p in listed["items"]]

    found = wait_for("three pod IPs", ips, lambda got: len(got) == 3 and all(got), timeout_s=60)
    network = ipaddress.ip_network(cluster.control_plane.pod_network.cidr)
    assert len(set(found)) == 3
    assert all(ipaddress.ip_address(ip) in network and ip != "127.0.0.1" for ip in found)
    # The same port on every pod's own address, as containers on a real node would.
    with contextlib.ExitStack() as sockets:
        for ip in found:
            sock = sockets.enter_context(socket.socket())
            sock.bind((ip, 8000))
            sock.listen()


def test_a_request_through_envoy_is_served_by_the_pod_the_epp_picked(pool: Pool) -> None:
    epp = pool.start_epp("epp-route")
    gateway = pool.gateway(epp)
    before = {e.address: served(e) for e in pool.runner.engines()}

    answer = first_answer(gateway)

    assert answer.choices[0].finish_reason in {"stop", "length"}
    (line,) = wait_for(
        "the access-log line of the 200",
        lambda: [line for line in gateway.access_log() if " 200 " in line],
        lambda lines: len(lines) > 0,
    )
    picked = line.split(" picked=")[1].split()[0]
    upstream = line.split(" upstream=")[1].split()[0]
    assert picked == upstream and picked in before
    after = {e.address: served(e) for e in pool.runner.engines()}
    assert after[picked] == before[picked] + 1
    assert all(after[other] == before[other] for other in before if other != picked)


def test_with_the_epp_stopped_fail_close_answers_503_and_fail_open_uses_the_fallback(
    pool: Pool,
) -> None:
    epp = pool.start_epp("epp-stop")
    closed = pool.gateway(epp)
    fallback = pool.runner.engines()[0]
    opened = pool.gateway(epp, failure_mode=FailureMode.FAIL_OPEN, fallback=fallback.address)
    first_answer(closed)

    pool.cluster.core.delete_namespaced_pod("epp-stop", pool.namespace)
    wait_for(
        "the EPP's process stopped with its pod",
        lambda: [p.pod for p in pool.runner.epps(ready_only=False)],
        lambda pods: "epp-stop" not in pods,
        timeout_s=60,
    )

    with pytest.raises(openai.APIStatusError) as refused:
        complete(closed)
    assert refused.value.status_code == 503

    # FailOpen can route around the EPP once Envoy's health check has seen it go (gateway.py).
    wait_for("Envoy to mark the EPP down", opened.epp_healthy, lambda up: not up, timeout_s=30)
    before = served(fallback)
    answer = complete(opened)
    assert answer.choices[0].finish_reason in {"stop", "length"}
    assert served(fallback) == before + 1
    assert opened.stats()["http.gateway.ext_proc.failure_mode_allowed"] >= 1
