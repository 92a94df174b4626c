"""The one poll-until-deadline loop of the tests: ``wait_until``.

Every wait in the tests (a server becoming ready, an operator's log line, the HPA's decision, a
control-plane component answering) goes through it, so they all behave alike: the predicate runs
at least once, a truthy value ends the wait and is returned, and at the deadline the error names
what was awaited and the last value seen (or the last ignored exception).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar, cast

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The predicate stayed falsy until the deadline (an AssertionError: a failed test)."""


def wait_until(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    interval: float,
    message: str | Callable[[], str],
    until: Callable[[T], object] = bool,
    ignore: tuple[type[BaseException], ...] = (),
    error: Callable[[str], BaseException] = WaitTimeout,
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns a truthy value (or one that
    ``until`` accepts); return that value.

    After ``timeout`` seconds raise ``error`` (``WaitTimeout`` unless told otherwise) with
    ``message`` (a string, or a callable evaluated only then, e.g. to read a log; its first line
    is followed by the last value). Exceptions of the ``ignore`` types count as "not yet" (the
    last one is reported); any other exception propagates at once, so a predicate can fail fast
    (a process that died).
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except ignore as exc:
            last = exc
        else:
            if until(cast(T, value)):
                return cast(T, value)
            last = value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            head, _, rest = text.partition("\n")  # the last value goes before any log lines
            tail = f"\n{rest}" if rest else ""
            raise error(f"timed out after {timeout:g} s: {head}; last value: {last!r}{tail}")
        time.sleep(interval)
