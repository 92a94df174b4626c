"""Pure: what the adapter loader saw -> ``status.adapters`` and the ``AdaptersReady`` condition.

One entry per adapter of ``spec.lora``, in the spec's order:
- ``Pending``: its download Job has not finished, no replica is ready, or a replica has not
  loaded it yet (a load in progress or a replica that did not answer; the reconcile retries);
- ``Loaded``: every ready replica serves it; ``Partial``: some do, the others are pending;
- ``Failed``: its download failed, or a replica refused it (the engine's message, naming the
  pod); the other adapters keep serving.

``AdaptersReady`` (present with ``spec.lora`` adapters) is True when every adapter is Loaded;
False with reason ``AdapterFailed`` (naming each failed adapter) or ``AdaptersPending``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


class AdapterState(enum.Enum):
    PENDING = "Pending"
    LOADED = "Loaded"
    PARTIAL = "Partial"
    FAILED = "Failed"


class PodFailure(NamedTuple):
    pod: str
    message: str


@dataclass(frozen=True)
class AdapterObservation:
    """One adapter across the ready replicas, as this reconcile found (and left) it."""

    name: str
    uri: str
    ready_pods: int  # ready replicas it should be on
    loaded_on: tuple[str, ...] = ()  # pods serving it from the spec's path, sorted
    failures: tuple[PodFailure, ...] = ()  # pods that refused it
    job: str | None = None  # hf://: its download Job
    # hf://: why it cannot be loaded yet (downloading, no Job) or, with ``download_failed``,
    # why it never will be until the spec changes.
    waiting_for: str | None = None
    download_failed: bool = False

    @property
    def state(self) -> AdapterState:
        if self.download_failed or self.failures:
            return AdapterState.FAILED
        if self.waiting_for is not None or not self.loaded_on:
            return AdapterState.PENDING
        if len(self.loaded_on) < self.ready_pods:
            return AdapterState.PARTIAL
        return AdapterState.LOADED

    @property
    def message(self) -> str:
        if self.failures:
            return "; ".join(f"pod {f.pod}: {f.message}" for f in self.failures)
        if self.waiting_for is not None:
            return self.waiting_for
        if not self.ready_pods:
            return "no replica is ready to load it"
        return f"loaded on {len(self.loaded_on)}/{self.ready_pods} ready replicas"


def adapters_status(adapters: Sequence[AdapterObservation]) -> list[dict[str, Any]]:
    rows = []
    for adapter in adapters:
        row: dict[str, Any] = {
            "name": adapter.name,
            "uri": adapter.uri,
            "state": adapter.state.value,
            "loadedOn": list(adapter.loaded_on),
        }
        if adapter.job is not None:
            row["job"] = adapter.job
        row["message"] = adapter.message
        rows.append(row)
    return rows


def adapters_condition(adapters: Sequence[AdapterObservation]) -> tuple[bool, str, str]:
    """``AdaptersReady``: (status, reason, message)."""
    failed = [a for a in adapters if a.state is AdapterState.FAILED]
    if failed:
        return False, "AdapterFailed", "; ".join(f"{a.name}: {a.message}" for a in failed)
    waiting = [a for a in adapters if a.state is not AdapterState.LOADED]
    if waiting:
        named = ", ".join(f"{a.name} ({a.state.value.lower()})" for a in waiting)
        return False, "AdaptersPending", f"not loaded everywhere yet: {named}"
    return True, "AdaptersLoaded", f"{len(adapters)} adapters loaded on every ready replica"
