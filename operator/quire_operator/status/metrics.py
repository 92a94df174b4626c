"""The operator's own Prometheus metrics: what it saw happen to the InferenceServices it serves.

``OperatorMetrics`` owns a registry of its own (never the process-wide default, so two operators
in one test process do not share counts). The ``Reconciler`` counts every transition it posts as
an Event, in the same place, so the counters and ``kubectl describe`` tell the same story; the
wake-ups of services that scale to zero get a counter of their own because that is what
dashboards and alerts ask for ("how often did this model cold-start today"). The held requests
and their hold time are the Endpoint Picker's metrics (docs/autoscaling.md), not repeated here.

Series carry the InferenceService's ``namespace`` and ``name`` (kube-state-metrics' convention;
the chart's PodMonitor keeps them with ``honorLabels``). Counters start at zero when the
operator starts, as every Prometheus counter does after a restart; the series of a deleted
InferenceService stay until then (one per Event reason it had, so a handful per service).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, start_http_server

from quire_operator.status.events import Transition

# The Event reason of a scale-up from zero replicas (events.transitions).
WAKE_UP_REASON = "ScaledFromZero"


class BindAddress(NamedTuple):
    host: str
    port: int


def parse_bind_address(text: str) -> BindAddress | None:
    """``HOST:PORT`` or ``:PORT`` (all interfaces) -> where to serve; ``""`` or ``"0"``: off.
    ``ValueError`` for anything else."""
    if text in ("", "0"):
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"metrics bind address {text!r} is not HOST:PORT or :PORT")
    return BindAddress(host.strip("[]") or "0.0.0.0", int(port))


class OperatorMetrics:
    """The counters, and the HTTP server that exposes them (``serve``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["namespace", "name"]
        self.events = Counter(
            "quire_operator_events",
            "Events the operator recorded about an InferenceService (counted also when the API "
            "server refused the Event), by type (Normal, Warning) and reason (Applied, Scaled, "
            "ScaledToZero, ScaledFromZero, Ready, NotReady, a Degraded reason, Recovered, ...)",
            [*labels, "type", "reason"],
            registry=self.registry,
        )
        self.wakeups = Counter(
            "quire_operator_wakeups",
            "Times an InferenceService that scales to zero was woken: its Deployment went from "
            "0 replicas to some (the ScaledFromZero Event)",
            labels,
            registry=self.registry,
        )

    def count(self, body: Mapping[str, Any], transition: Transition) -> None:
        """Count one posted transition of the InferenceService ``body`` (its metadata)."""
        metadata = body["metadata"]
        namespace, name = metadata["namespace"], metadata["name"]
        self.events.labels(namespace, name, transition.type, transition.reason).inc()
        if transition.reason == WAKE_UP_REASON:
            self.wakeups.labels(namespace, name).inc()

    def serve(self, address: BindAddress) -> None:
        """Serve ``/metrics`` (any path, in fact) on a daemon thread; ``OSError`` if the port is
        taken."""
        start_http_server(address.port, address.host, registry=self.registry)
