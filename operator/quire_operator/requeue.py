"""Retries with backoff and a slow periodic resync: what watch events alone cannot guarantee.

A reconcile started by a watch event can fail (the API server answers 5xx, 409 or 429, or not at
all), or can find something only time fixes (an object of the same name that is not ours, see
reconcile/). kopf retries its own create/update handlers, but not event handlers, and an event
that was missed (a dropped watch, an operator that was down) is never delivered again. So every
trigger runs its reconcile through ``Requeue.run``:

- a failure or a retry-worthy problem schedules the same reconcile again after a backoff that
  doubles from ``backoff_s`` up to ``max_backoff_s`` (with up to 20% jitter, so a burst of
  failures does not come back as a burst), until one succeeds;
- every ``resync_s`` every InferenceService in scope is reconciled, repairing whatever was missed.

Ownership: one daemon thread (``start``/``stop``) runs the schedule; ``_due`` (when each key's
retry is due) and ``_failures`` (consecutive failures per key, reset by a success) are shared
with the callers of ``run`` and only touched under ``_lock``;
reconciles themselves run on that thread or on the caller's (kopf's handler threads) and are
serialized per object by the Reconciler. ``active`` (peering, see peering.py) is asked before
each scheduled run: a paused operator replica neither retries nor resyncs.
"""

from __future__ import annotations

import functools
import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import urllib3
from kubernetes.client.exceptions import ApiException

from quire_operator.children import api_message, retriable
from quire_operator.reconcile.reconciler import Reconciler

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class RequeueConfig:
    resync_s: float = 300.0  # a full pass every 5 minutes: slow, watches do the fast work
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")
        if self.resync_s <= 0:
            raise ValueError(f"resync_s must be > 0; got {self.resync_s}")


class Requeue:
    def __init__(
        self,
        reconciler: Reconciler,
        list_keys: Callable[[], Iterable[Key]],
        active: Callable[[], bool],
        config: RequeueConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reconciler = reconciler
        self._list_keys = list_keys
        self._active = active
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._heap: list[tuple[float, Key]] = []
        self._due: dict[Key, float] = {}  # key -> when its retry is due
        self._failures: dict[Key, int] = {}  # key -> consecutive failed attempts
        self._thread: threading.Thread | None = None

    def run(self, namespace: str, name: str) -> None:
        """Reconcile now; on failure, again later (see the module docstring). Raises only what
        is not worth retrying (a bug, a 4xx the reconciler did not expect)."""
        key = (namespace, name)
        try:
            problem = self._reconciler.reconcile(namespace, name)
        except ApiException as err:
            if not retriable(err):
                self._forget(key)
                raise
            why = f"{err.status} {api_message(err)}" if err.status else str(err.reason)
            self._failed(key, why)
            return
        except (OSError, urllib3.exceptions.HTTPError) as err:
            # Connection refused or reset, a read timeout: the API server is away or slow.
            self._failed(key, f"{type(err).__name__}: {err}")
            return
        if problem is not None and problem.retry:
            self._failed(key, problem.reason)
        else:
            self._forget(key)  # done (or needs a spec change, which is an event of its own)

    def _forget(self, key: Key) -> None:
        with self._lock:
            self._failures.pop(key, None)
            self._due.pop(key, None)

    def backoff(self, attempts: int) -> float:
        """Seconds before retry number ``attempts`` (1, 2, ...), before jitter."""
        return min(self._config.backoff_s * 2 ** (attempts - 1), self._config.max_backoff_s)

    def pending(self) -> dict[Key, int]:
        """Keys waiting for a retry -> consecutive failures so far (for logs and tests)."""
        with self._lock:
            return {key: self._failures[key] for key in self._due}

    def _failed(self, key: Key, why: str) -> None:
        """Count the failure and schedule the retry (a later one replaces an earlier one)."""
        with self._lock:
            attempts = self._failures[key] = self._failures.get(key, 0) + 1
            delay = self.backoff(attempts) * (1 + random.uniform(0, 0.2))
            when = self._clock() + delay
            self._due[key] = when
            heapq.heappush(self._heap, (when, key))
        logger.info("%s/%s: retry %d in %.1fs (%s)", *key, attempts, delay, why)
        self._wake.set()

    # -- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="quire-requeue", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        next_resync = self._clock() + self._config.resync_s
        while not self._stopping.is_set():
            now = self._clock()
            if now >= next_resync:
                next_resync = now + self._config.resync_s
                self._guarded(self._resync)
            for key in self._pop_due(now):
                if self._active():
                    self._guarded(functools.partial(self.run, *key))
                else:  # the active replica owns it now
                    self._forget(key)
            with self._lock:
                wake_at = min([next_resync, *(when for when, _ in self._heap[:1])])
            self._wake.wait(timeout=max(0.05, wake_at - self._clock()))
            self._wake.clear()

    def _pop_due(self, now: float) -> list[Key]:
        """Keys whose retry is due, removed from the schedule (an attempt that fails again puts
        its key back)."""
        due = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                when, key = heapq.heappop(self._heap)
                if self._due.get(key) == when:  # else superseded or forgotten
                    del self._due[key]
                    due.append(key)
        return due

    def _resync(self) -> None:
        if not self._active():
            return
        keys = list(self._list_keys())
        logger.info("resync: reconciling %d InferenceService(s)", len(keys))
        for key in keys:
            if self._stopping.is_set():
                return
            self._guarded(functools.partial(self.run, *key))

    def _guarded(self, call: Callable[[], None]) -> None:
        """Run ``call`` if this replica is active; log (never propagate) what it raises, so the
        thread outlives any one bad object."""
        try:
            if self._active():
                call()
        except Exception:
            logger.exception("requeue: unexpected error")
