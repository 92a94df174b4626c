"""``tests.waiting.wait_until``: gated on call counts, never on the machine's speed (interval 0,
and a timeout of 0 means "one call, then the deadline has passed")."""

from __future__ import annotations

import pytest

from tests.waiting import WaitTimeout, wait_until


class Counter:
    """Returns ``values[i]`` on its i-th call (the last one from then on)."""

    def __init__(self, *values: object) -> None:
        self.values = values
        self.calls = 0

    def __call__(self) -> object:
        value = self.values[min(self.calls, len(self.values) - 1)]
        self.calls += 1
        return value


def test_returns_the_first_truthy_value() -> None:
    predicate = Counter(None, 0, "", {"ready": 1})
    assert wait_until(predicate, timeout=60, interval=0, message="x") == {"ready": 1}
    assert predicate.calls == 4


def test_a_truthy_first_call_returns_at_once_even_with_no_time_left() -> None:
    predicate = Counter(7)
    assert wait_until(predicate, timeout=0, interval=0, message="x") == 7
    assert predicate.calls == 1


def test_the_deadline_raises_an_assertion_with_the_message_and_the_last_value() -> None:
    predicate = Counter([], [1, 2, 3], 0)
    with pytest.raises(WaitTimeout) as caught:
        wait_until(predicate, timeout=0, interval=0, message="the replicas")
    assert isinstance(caught.value, AssertionError)
    assert predicate.calls == 1  # checked once: the deadline had passed by then
    assert "the replicas" in str(caught.value)
    assert "last value: []" in str(caught.value)


def test_a_message_callable_runs_only_at_the_deadline() -> None:
    reads = Counter("log text")

    def logs() -> str:
        return str(reads())

    assert wait_until(Counter(False, True), timeout=60, interval=0, message=logs) is True
    assert reads.calls == 0
    with pytest.raises(AssertionError, match="log text"):
        wait_until(Counter(False), timeout=0, interval=0, message=logs)
    assert reads.calls == 1


def test_ignored_exceptions_mean_not_yet_and_the_last_one_is_reported() -> None:
    calls = Counter(0, 0, 1)

    def flaky() -> int:
        if calls() == 0:
            raise ConnectionRefusedError("not up yet")
        return 5

    assert wait_until(flaky, timeout=60, interval=0, message="x", ignore=(OSError,)) == 5
    assert calls.calls == 3

    def down() -> int:
        raise ConnectionRefusedError("still down")

    with pytest.raises(WaitTimeout, match="still down"):
        wait_until(down, timeout=0, interval=0, message="x", ignore=(OSError,))


def test_other_exceptions_propagate_at_once() -> None:
    calls = Counter(None)

    def dead() -> bool:
        calls()
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(dead, timeout=60, interval=0, message="x", ignore=(OSError,))
    assert calls.calls == 1


def test_the_error_type_can_be_chosen() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="the API server"):
        wait_until(Counter(False), timeout=0, interval=0, message="the API server", error=Boom)


def test_until_accepts_a_value_even_a_falsy_one_and_the_last_value_is_the_fetched_one() -> None:
    replicas = Counter(3, 2, 0)
    assert wait_until(replicas, timeout=60, interval=0, message="x", until=lambda n: n == 0) == 0
    assert replicas.calls == 3
    with pytest.raises(WaitTimeout, match="last value: 3"):
        wait_until(Counter(3), timeout=0, interval=0, message="x", until=lambda n: n == 0)
