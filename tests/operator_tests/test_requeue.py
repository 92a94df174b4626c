"""Unit tests of the operator's fault handling without a cluster: retries, resync, Events, peers.

The reconciler is a scripted stand-in (what it returns or raises per call), so the backoff and
the bookkeeping are checked exactly; tests/operator_tests/test_faults.py proves the same paths
against the real API server.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from quire_operator.peering import wins
from quire_operator.requeue import Requeue, RequeueConfig
from quire_operator.status.conditions import Problem
from quire_operator.status.events import Transition, transitions
from tests.cluster.client import wait_for

KEY = ("ml", "llm")


class Scripted:
    """Answers reconcile calls from a script: a Problem/None to return, or an exception."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def reconcile(self, namespace: str, name: str) -> Problem | None:
        with self.lock:
            self.calls.append((namespace, name))
            outcome = self.script.pop(0) if self.script else None
        if isinstance(outcome, BaseException):
            raise outcome
        result: Problem | None = outcome
        return result


def requeue(
    reconciler: Scripted, keys: list[tuple[str, str]] | None = None, **config: float
) -> Requeue:
    return Requeue(
        reconciler,  # type: ignore[arg-type]  # duck-typed: only reconcile()
        lambda: keys or [],
        lambda: True,
        RequeueConfig(**config),
    )


@pytest.fixture
def running() -> Iterator[list[Requeue]]:
    started: list[Requeue] = []
    yield started
    for queue in started:
        queue.stop()


def test_backoff_doubles_up_to_the_cap() -> None:
    queue = requeue(Scripted(), backoff_s=1, max_backoff_s=8)
    assert [queue.backoff(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]


@pytest.mark.parametrize(
    "failure",
    [
        *(ApiException(status=status, reason="boom") for status in (500, 503, 409, 429, None)),
        urllib3.exceptions.MaxRetryError(
            urllib3.HTTPConnectionPool("127.0.0.1"), "/apis", ConnectionRefusedError("refused")
        ),
        ConnectionResetError("reset by peer"),
    ],
    ids=["500", "503", "409", "429", "timeout", "refused", "reset"],
)
def test_retriable_failures_are_scheduled_and_retried_until_they_succeed(
    failure: Exception, running: list[Requeue]
) -> None:
    reconciler = Scripted(failure, failure, None)
    queue = requeue(reconciler, backoff_s=0.05, max_backoff_s=0.1)
    queue.run(*KEY)  # the first attempt fails: scheduled, not raised
    assert queue.pending() == {KEY: 1}
    queue.start()
    running.append(queue)
    wait_for("three attempts", lambda: len(reconciler.calls), lambda n: n == 3, timeout_s=10)
    wait_for("nothing pending", queue.pending, lambda p: p == {}, timeout_s=5)


def test_a_refusal_is_not_retried_but_raised() -> None:
    queue = requeue(Scripted(ApiException(status=403, reason="Forbidden")))
    with pytest.raises(ApiException):
        queue.run(*KEY)
    assert queue.pending() == {}


def test_a_retry_worthy_problem_is_retried_and_a_fresh_trigger_keeps_the_count() -> None:
    not_owned = Problem("NotOwned", "Service llm is someone else's", retry=True)
    reconciler = Scripted(not_owned, not_owned, Problem("ApplyFailed", "no"))
    queue = requeue(reconciler, backoff_s=60, max_backoff_s=60)
    queue.run(*KEY)
    queue.run(*KEY)  # an event meanwhile: runs now, still failing, second attempt counted
    assert queue.pending() == {KEY: 2}
    queue.run(*KEY)  # a problem that no retry fixes (the spec must change): dropped
    assert queue.pending() == {}


def test_resync_reconciles_every_object_in_scope(running: list[Requeue]) -> None:
    reconciler = Scripted()
    keys = [("a", "one"), ("b", "two")]
    queue = requeue(reconciler, keys, resync_s=0.1)
    queue.start()
    running.append(queue)
    wait_for(
        "two resync passes",
        lambda: list(reconciler.calls),
        lambda calls: calls[:4] == keys + keys,
        timeout_s=10,
    )


def test_a_paused_replica_neither_retries_nor_resyncs(running: list[Requeue]) -> None:
    reconciler = Scripted(ApiException(status=500, reason="x"))
    queue = Requeue(
        reconciler,  # type: ignore[arg-type]
        lambda: [KEY],
        lambda: False,
        RequeueConfig(resync_s=0.05, backoff_s=0.05, max_backoff_s=0.05),
    )
    queue.run(*KEY)  # handlers only run while kopf lets this replica work
    queue.start()
    running.append(queue)
    wait_for("the due retry dropped", queue.pending, lambda p: p == {}, timeout_s=5)
    assert reconciler.calls == [KEY]


def status(generation: int, desired: int, **conditions: tuple[str, str, str]) -> dict[str, Any]:
    return {
        "observedGeneration": generation,
        "desiredReplicas": desired,
        "conditions": [
            {"type": kind, "status": value, "reason": reason, "message": message}
            for kind, (value, reason, message) in conditions.items()
        ],
    }


READY = ("True", "ReplicasReady", "1/1 replicas ready")
DONE = ("False", "RolloutComplete", "1/1 replicas up to date")
FINE = ("False", "AsExpected", "")


def test_events_name_each_transition_once() -> None:
    created = status(1, 1, Ready=READY, Progressing=DONE, Degraded=FINE)
    assert transitions({}, created) == [
        Transition("Normal", "Applied", "applied generation 1"),
        Transition("Normal", "Ready", "1/1 replicas ready"),
    ]
    assert transitions(created, created) == []  # a reconcile that changes nothing posts nothing

    scaled = status(1, 3, Ready=READY, Progressing=DONE, Degraded=FINE)
    assert transitions(created, scaled) == [
        Transition("Normal", "Scaled", "scaled from 1 to 3 replicas")
    ]
    blocked = ("True", "NotOwned", 'Service "llm" already exists')
    refused = status(2, 3, Ready=READY, Progressing=("False", *blocked[1:]), Degraded=blocked)
    # Generation 2 was not applied: no Applied event, the Warning says why.
    assert transitions(scaled, refused) == [Transition("Warning", "NotOwned", blocked[2])]
    # While blocked, a scale does not count: no Deployment of ours moved.
    assert transitions(refused, {**refused, "desiredReplicas": 0}) == []
    assert transitions(refused, refused) == []
    recovered = status(2, 3, Ready=READY, Progressing=DONE, Degraded=FINE)
    # The same generation, applied once the obstacle went.
    assert transitions(refused, recovered) == [
        Transition("Normal", "Applied", "applied generation 2"),
        Transition("Normal", "Recovered", "no longer degraded (NotOwned resolved)"),
    ]
    lost = status(2, 3, Ready=("False", "NoReplicaReady", "0/3 replicas ready"),
                  Progressing=DONE, Degraded=FINE)  # fmt: skip
    assert transitions(recovered, lost) == [Transition("Warning", "NotReady", "0/3 replicas ready")]


def test_peering_rule_is_kopfs() -> None:
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    seen = now.isoformat()
    stale = (now - datetime.timedelta(seconds=61)).isoformat()
    epoch = now.timestamp()
    me = {"priority": 10, "lastseen": seen, "lifetime": 60}
    assert wins({"me": me}, "me", 10, epoch)
    assert wins({"me": me, "low": {**me, "priority": 5}}, "me", 10, epoch)
    assert not wins({"me": me, "high": {**me, "priority": 20}}, "me", 10, epoch)
    assert not wins({"me": me, "twin": me}, "me", 10, epoch)  # kopf pauses equal priorities
    assert wins({"me": me, "dead": {**me, "priority": 20, "lastseen": stale}}, "me", 10, epoch)
