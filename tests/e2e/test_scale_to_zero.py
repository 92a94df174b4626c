"""Scale to zero end to end: requests that arrive at zero replicas are held by the Endpoint
Picker's flow control, wake the Deployment through KEDA, and are served once a replica is ready.

The chain, all real: Envoy (the Gateway, ext_proc to the picker, the Gateway's local replies as
OpenAI-shaped 503s with ``Retry-After``) -> the picker (GIE v1.5.0, flow control on, run as its
pod) holding requests -> Prometheus scraping the picker's ``flow_control_queue_size`` -> KEDA
(the ScaledObject the operator wrote, ``minReplicaCount: 0``, the held-requests trigger) -> the
HPA controller / KEDA's own 0 <-> 1 -> Deployment -> the kubelet stand-in starting the engine.

One InferenceService goes through every step in order (each step starts at zero), so the
control plane and picker are set up once: held requests served exactly once with the same greedy
text as a warm replica gives, back to zero after the idle period, a burst beyond the queue bound
(the excess refused, counted, each with ``Retry-After``), and a request sent as the last replica
is being removed.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx2
import pytest

from tests.cluster.gateway import Gateway, GatewayConfig
from tests.cluster.routing import RoutingStack
from tests.e2e.routed_fleet import access_log, engine_metrics, save_report
from tests.e2e.scaling_scenario import STEP_TIMEOUT_S, Scenario, poll
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.operator_tests.operator_process import Operators

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

QUEUE = 6  # scaleToZero.queueSize: the picker holds at most this many requests
HOLD_S = 150  # scaleToZero.holdTimeoutSeconds: far above a tiny engine's cold start here
COOLDOWN_S = 8  # keda.cooldownPeriod: idle seconds before KEDA takes the last replica away
RETRY_AFTER_S = 5
MAX_TOKENS = 12


class Answer(NamedTuple):
    """One request through the Gateway: its id, what came back and when (monotonic seconds)."""

    request_id: str
    status: int
    text: str
    response_id: str
    retry_after: str | None
    error_code: str | None
    sent: float
    first_token: float | None


def ask(gateway: Gateway, model: str, prompt: str, *, stream: bool = False) -> Answer:
    """One greedy completion with a fresh ``x-request-id``, over plain HTTP so that a refusal's
    status, headers and body are seen as sent (no client retries)."""
    request_id = uuid.uuid4().hex
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"x-request-id": request_id}
    sent = time.monotonic()
    with (
        httpx2.Client(timeout=HOLD_S + 60) as http,
        http.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=headers) as reply,
    ):
        if reply.status_code != 200:
            error = httpx2.Response(reply.status_code, content=reply.read()).json()["error"]
            return Answer(
                request_id, reply.status_code, "", "", reply.headers.get("retry-after"),
                error.get("code"), sent, None,
            )  # fmt: skip
        if not stream:
            answer = httpx2.Response(200, content=reply.read()).json()
            text = answer["choices"][0]["text"]
            return Answer(request_id, 200, text, answer["id"], None, None, sent, None)
        pieces, first, response_id = [], None, ""
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            response_id = chunk["id"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.monotonic()
                pieces.append(chunk["choices"][0]["text"])
        return Answer(request_id, 200, "".join(pieces), response_id, None, None, sent, first)


def at_once(count: int, send: Callable[[int], Answer]) -> list[Answer]:
    """``count`` requests released together (a barrier), answers in index order."""
    answers: list[Answer | BaseException | None] = [None] * count
    barrier = threading.Barrier(count)

    def one(index: int) -> None:
        barrier.wait()
        try:
            answers[index] = send(index)
        except Exception as err:  # reported below, with the others
            answers[index] = err

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=HOLD_S + 90)
    assert all(not t.is_alive() for t in threads), "a request hung"
    done = [a for a in answers if isinstance(a, Answer)]
    assert len(done) == count, answers
    return done


def served_total(s: Scenario) -> float:
    return sum(
        engine_metrics(e).get("quire_request_success_total", 0.0) for e in s.runner.engines()
    )


def condition(s: Scenario, kind: str) -> dict[str, Any]:
    conditions = s.inference_service().get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def flow_control_outcomes(s: Scenario) -> dict[str, int]:
    """Requests that left the picker's flow control, per outcome, from Prometheus."""
    query = (
        "sum by (outcome) (inference_extension_flow_control_request_queue_duration_seconds_count"
        f'{{namespace="{s.namespace}",inference_pool="{s.name}"}})'
    )
    return {r["metric"]["outcome"]: int(float(r["value"][1])) for r in s.stack.query(query)}


def expect_zero(s: Scenario, what: str) -> None:
    """KEDA takes the Deployment to 0, the engine stops, the status says so."""
    poll(f"Deployment at 0 ({what})", s.deployment_replicas, lambda n: n == 0, STEP_TIMEOUT_S)
    s.timeline.mark(f"Deployment at 0 replicas ({what})")
    poll("no engine left", lambda: len(s.runner.engines(ready_only=False)), lambda n: n == 0, 60)
    poll(
        "ScaledToZero=True",
        lambda: condition(s, "ScaledToZero").get("status"),
        lambda status: status == "True",
        60,
    )


def test_requests_at_zero_are_held_until_a_replica_is_ready_and_excess_gets_503(
    routing: RoutingStack, scenario: Callable[..., Scenario], operators: Operators
) -> None:
    s = scenario("zero", "keda", routing)
    s.create(
        {"targetQueueDepth": 4},
        max_num_seqs=8,
        num_blocks=256,
        min_replicas=0,
        max_replicas=1,
        keda={"cooldownPeriod": COOLDOWN_S},
        extra={"scaleToZero": {"queueSize": QUEUE, "holdTimeoutSeconds": HOLD_S}},
    )
    epp = wait_until(
        lambda: next(iter(s.runner.epps()), None),
        timeout=STEP_TIMEOUT_S,
        interval=0.3,
        message=lambda: f"the endpoint picker serving\n{s.runner.errors}",
    )
    gateway = routing.gateway(
        GatewayConfig(epp=epp.address, request_timeout_s=HOLD_S + 30, retry_after_s=RETRY_AFTER_S)
    )
    expect_zero(s, "created idle")
    report: dict[str, Any] = {"name": "scale to zero"}

    # 1. QUEUE requests at zero, released together: all held, all served once a replica is up.
    prompts = [f"held request number {i}" for i in range(QUEUE)]
    started = s.timeline.mark(f"{QUEUE} requests sent at zero replicas")
    answered: list[list[Answer]] = []
    sender = threading.Thread(
        target=lambda: answered.append(
            at_once(QUEUE, lambda i: ask(gateway, s.name, prompts[i], stream=True))
        ),
        daemon=True,
    )
    sender.start()
    # While they wait, the status says the service is waking and how many requests are held.
    waking = poll(
        "ScaledToZero reason Waking",
        lambda: condition(s, "ScaledToZero"),
        lambda c: c.get("reason") == "Waking" or not sender.is_alive(),
        STEP_TIMEOUT_S,
    )
    s.timeline.mark(f"status: {waking.get('message')}")
    assert re.fullmatch(
        r"waking: 1 replicas starting, [1-6] requests held by the endpoint picker",
        waking.get("message", ""),
    ), waking
    sender.join(timeout=HOLD_S + 120)
    (held,) = answered
    assert [a.status for a in held] == [200] * QUEUE, held
    first = min(a.first_token for a in held if a.first_token is not None)
    report["first_token_from_zero_s"] = round(first - min(a.sent for a in held), 2)
    s.timeline.mark(f"first token {report['first_token_from_zero_s']} s after the first request")
    (engine,) = s.runner.engines()
    assert engine.ready_at is not None
    report["engine_ready_from_zero_s"] = round(engine.ready_at - s.timeline.t0 - started, 2)
    # The engine saw each request once, under the id the client gave it.
    assert [a.response_id for a in held] == [f"cmpl-{a.request_id}" for a in held]
    assert served_total(s) == QUEUE
    # A warm replica gives the same greedy text.
    warm = [ask(gateway, s.name, prompt) for prompt in prompts]
    assert [a.text for a in warm] == [a.text for a in held]
    assert served_total(s) == 2 * QUEUE
    logged = access_log(gateway, ids=[a.request_id for a in [*held, *warm]])
    assert {line.upstream for line in logged} == {engine.address}

    # 2. Idle for the cooldown: back to zero, with Events both ways.
    expect_zero(s, "idle after serving")
    reasons = {e.reason for e in s.cluster.core.list_namespaced_event(s.namespace).items}
    assert {"ScaledFromZero", "ScaledToZero"} <= reasons, reasons
    # Wake-ups are a metric too: the operator counts each ScaledFromZero Event it posts.
    (operator,) = operators.started
    labels = {"namespace": s.namespace, "name": s.name}
    woken = len(
        [
            e
            for e in s.cluster.core.list_namespaced_event(s.namespace).items
            if e.reason == "ScaledFromZero" and e.involved_object.name == s.name
        ]
    )
    poll(
        f"the operator's wake-up counter at {woken} (its ScaledFromZero Events)",
        lambda: operator.sample("quire_operator_wakeups_total", labels),
        lambda value: value == woken,
        30,
    )
    report["wakeups"] = woken
    last = s.inference_service()["status"]["autoscaler"]["lastScale"]
    assert (last["from"], last["to"], last["direction"]) == (1, 0, "Down"), last

    # 3. A burst beyond the bound: QUEUE held and served, the rest refused at once with 503.
    burst = QUEUE + 5
    answers = at_once(burst, lambda i: ask(gateway, s.name, f"burst {i}"))
    s.timeline.mark(f"burst of {burst} answered")
    refused = [a for a in answers if a.status != 200]
    assert len(refused) == burst - QUEUE, answers
    assert all(a.status == 503 and a.retry_after == str(RETRY_AFTER_S) for a in refused), refused
    assert all(a.error_code == "queue_full" for a in refused), refused
    assert sum(a.status == 200 for a in answers) == QUEUE
    report["burst"] = {"sent": burst, "refused": len(refused), "served": burst - len(refused)}

    # 4. The last replica being removed: a request sent as KEDA takes it away is still served,
    # by that replica while it drains or, held, by the next one.
    poll("KEDA taking the last replica", s.deployment_replicas, lambda n: n == 0, STEP_TIMEOUT_S)
    s.timeline.mark("Deployment set to 0: a request sent now")
    late = ask(gateway, s.name, prompts[0])
    assert late.status == 200 and late.text == held[0].text, late
    s.timeline.mark("the request sent during removal was served")

    # 5. The picker counted it all, as Prometheus scraped it: every request through the flow
    # control (dispatched, held or not) and the refusals, with the time each spent there.
    requests = 2 * QUEUE + burst + 1
    outcomes = poll(
        "the picker's flow-control outcomes in Prometheus",
        lambda: flow_control_outcomes(s),
        lambda seen: seen.get("Dispatched", 0) + seen.get("RejectedCapacity", 0) >= requests,
        60,
    )
    assert outcomes == {"Dispatched": requests - len(refused), "RejectedCapacity": len(refused)}
    report["flow_control_outcomes"] = outcomes
    save_report("scale to zero", report)
