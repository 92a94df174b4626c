"""Prometheus metrics of the server, each declared once (the reference, docs/metrics.md, is
generated from this registry), plus the recorder that feeds them from the engine thread.

``ServerMetrics`` owns one ``CollectorRegistry`` per app (never the global one), so tests and
benchmarks can build several servers in one process. Every series carries ``model_name``.

``StatsRecorder`` is owned by the engine thread (see ``async_engine``): it is the only writer, and
it is handed a ``SchedulerStats`` snapshot taken on that thread right after a step or after
commands were applied, so the gauges describe a consistent state, and it never holds the live
scheduler. prometheus-client's own locks make the
scrape from the event-loop thread safe. The recorder also writes the one log line per finished
request and the (rate-limited) preemption warnings.
"""

from __future__ import annotations

import bisect
import gc
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric

from quire_engine.core.config import PreemptionMode
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.scheduler import KV_DEMAND_OUTPUT_SHARE, SchedulerStats
from quire_engine.core.sequence import FinishReason

logger = logging.getLogger(__name__)

# Buckets for LLM serving: a decode step is milliseconds on a GPU and tens of milliseconds on a
# CPU; a first token waits for the queue and a whole prefill (up to seconds under load); a request
# lives seconds to minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 6.0, 12.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
# A young collection is about half a millisecond in a loaded server on a small CPU; a full one
# over an unfrozen heap of torch, transformers and a model is a quarter of a second.
GC_PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# A warning per preemption would flood the log exactly when the server is overloaded.
PREEMPTION_WARNING_INTERVAL_S = 10.0


class BatchHistogram:
    """A Prometheus histogram that takes many equal observations at once (``observe_many``).

    The inter-token latency has one observation per running sample per step, and within a step
    most of them are equal (the time since the previous step). ``prometheus_client.Histogram``
    costs one call, a scan of the bounds and two locks per observation (about 1.4 ms per step at
    256 sequences, more than the step itself); here a step's observations are grouped by value
    and applied under one lock. Exposed like ``Histogram`` (``_bucket`` with ``le``, ``_count``,
    ``_sum``) by a collector that reads it under the same lock, so a scrape never sees a step
    half applied."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        model_name: str,
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = [float(b) for b in buckets if b != float("inf")]
        self.model_name = model_name
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket (not cumulative); last: +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, counts: dict[float, int]) -> None:
        """Observe each value ``counts[value]`` times."""
        bounds = self.bounds
        with self._lock:
            for value, n in counts.items():
                self._counts[bisect.bisect_left(bounds, value)] += n  # le: value <= bound
                self._sum += value * n

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, n in zip([*self.bounds, float("inf")], counts, strict=True):
            cumulative += n
            buckets.append((_le(bound), float(cumulative)))
        family.add_metric([self.model_name], buckets, total)
        return [family]


def _le(bound: float) -> str:
    """A bucket bound as Prometheus client libraries write it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class ServerMetrics:
    """The metric objects, already bound to this server's ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg = self.registry
        name = ["model_name"]

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, name, registry=reg).labels(model_name)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, name, registry=reg).labels(model_name)

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, doc, name, buckets=buckets, registry=reg).labels(model_name)

        self.kv_usage = gauge("quire_kv_cache_usage_ratio", "Used KV blocks / total blocks (0-1).")
        self.kv_demand = gauge(
            "quire_kv_cache_demand_ratio",
            "(Used KV blocks + blocks unfinished requests still need for their known tokens and "
            f"{KV_DEMAND_OUTPUT_SHARE:g} of their remaining max_tokens) / total blocks; > 1 means "
            "queueing or preemption ahead.",
        )
        self.kv_blocks_capacity = gauge("quire_kv_blocks_capacity", "KV blocks in the device pool.")
        self.kv_blocks_free = gauge(
            "quire_kv_blocks_free", "Unreferenced KV blocks (including cached prefixes)."
        )
        self.running = gauge("quire_num_requests_running", "Sequences running on the device.")
        self.waiting = gauge("quire_num_requests_waiting", "Sequences waiting to be scheduled.")
        self.swapped = gauge("quire_num_requests_swapped", "Sequences swapped out to CPU.")
        self._preemptions = Counter(
            "quire_preemptions_total",
            "Sequences preempted because the KV pool ran dry.",
            ["model_name", "mode"],
            registry=reg,
        )
        self.preemptions = {
            mode: self._preemptions.labels(model_name, mode.value) for mode in PreemptionMode
        }
        self.prefix_queries = counter(
            "quire_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "quire_prefix_cache_hits_total", "Prompt tokens found in the prefix cache."
        )
        self.prompt_tokens = counter("quire_prompt_tokens_total", "Prefilled prompt tokens.")
        self.generation_tokens = counter("quire_generation_tokens_total", "Generated tokens.")
        self._success = Counter(
            "quire_request_success_total",
            "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.ttft = histogram(
            "quire_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = BatchHistogram(
            "quire_inter_token_latency_seconds",
            "Time between tokens of a sample.",
            ITL_BUCKETS,
            model_name,
            reg,
        )
        self.e2e = histogram(
            "quire_e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "quire_request_queue_time_seconds", "Arrival to first scheduled.", QUEUE_BUCKETS
        )
        for reason in FinishReason:  # export zeros before the first request
            self._success.labels(model_name, reason)

    def success(self, reason: FinishReason) -> Counter:
        return self._success.labels(self.model_name, reason)


@dataclass(slots=True)
class _Timeline:
    """What the recorder remembers of one live engine request (one prompt)."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)  # per sample index
    seen: dict[int, int] = field(default_factory=dict)  # tokens already counted, per sample


class StatsRecorder:
    """Turns engine steps into metric updates and log lines. Engine thread only."""

    def __init__(self, metrics: ServerMetrics, stats: SchedulerStats) -> None:
        self.metrics = metrics
        self._stats = stats
        self._live: dict[str, _Timeline] = {}  # timestamps are time.monotonic() seconds
        self._queued: dict[str, _Timeline] = {}  # live and never scheduled yet
        # Counters in the scheduler and the pool are cumulative (and include the warmup request):
        # only their growth since the last look is added to the Prometheus counters.
        self._seen_preemptions = dict(stats.num_preemptions)
        self._seen_queries = stats.prefix_queries
        self._seen_hits = stats.prefix_hits
        self._unreported: dict[PreemptionMode, int] = dict.fromkeys(PreemptionMode, 0)
        self._last_warning = float("-inf")
        self.refresh(stats)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def added(self, request_id: str, num_prompt_tokens: int, arrival: float) -> None:
        line = _Timeline(arrival, num_prompt_tokens)
        self._live[request_id] = self._queued[request_id] = line

    def aborted(self, request_id: str, now: float) -> None:
        self._queued.pop(request_id, None)
        line = self._live.pop(request_id, None)
        if line is not None:
            self.metrics.success(FinishReason.ABORT).inc()
            self._log_finished(request_id, line, FinishReason.ABORT, now)

    def step(
        self, outputs: list[RequestOutput], start: float, end: float, stats: SchedulerStats
    ) -> None:
        """Account for one ``engine.step()`` that ran from ``start`` to ``end``, after which the
        scheduler's state was ``stats``; also refreshes the gauges from it."""
        self._stats = stats
        m = self.metrics
        progressed = {out.request_id for out in outputs}
        for rid in [r for r in self._queued if r in progressed or self._left_queue(r)]:
            m.queue_time.observe(max(0.0, start - self._queued.pop(rid).arrival))
        # Once per request per step: counters and the inter-token histogram are added up here
        # and applied once per step.
        itl: dict[float, int] = {}
        generated = prompts = 0
        for out in outputs:
            line = self._live.get(out.request_id)
            if line is None:
                continue
            new_tokens = 0
            for sample in out.outputs:
                count = len(sample.token_ids)
                fresh = count - line.seen.get(sample.index, 0)
                if fresh <= 0:
                    continue
                new_tokens += fresh
                line.seen[sample.index] = count
                previous = line.last_token.get(sample.index)
                if previous is not None:
                    gap = end - previous
                    itl[gap] = itl.get(gap, 0) + 1
                line.last_token[sample.index] = end
            if new_tokens and line.first_token is None:
                line.first_token = end
                m.ttft.observe(end - line.arrival)
                prompts += line.num_prompt_tokens
            generated += new_tokens
            if out.finished:
                del self._live[out.request_id]
                reason = (
                    out.outputs[0].finish_reason if out.outputs else None
                ) or FinishReason.ABORT
                m.e2e.observe(end - line.arrival)
                m.success(reason).inc()
                self._log_finished(out.request_id, line, reason, end)
        if itl:
            m.itl.observe_many(itl)
        if generated:
            m.generation_tokens.inc(generated)
        if prompts:
            m.prompt_tokens.inc(prompts)
        self._count_cache_and_preemptions(end)
        self.refresh(stats)

    def refresh(self, stats: SchedulerStats) -> None:
        """Gauges from a snapshot of the scheduler and pool state."""
        self._stats = stats
        m, pool = self.metrics, stats.pool
        m.kv_usage.set(pool.usage)
        m.kv_demand.set(stats.kv_demand_blocks / pool.total)
        m.kv_blocks_capacity.set(pool.total)
        m.kv_blocks_free.set(pool.free)
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting)
        m.swapped.set(stats.num_swapped)

    def _left_queue(self, request_id: str) -> bool:
        # The engine names a request's first sequence "<request_id>/0"; it leaves WAITING when the
        # scheduler first gives it blocks (possibly for the first chunk of a chunked prefill), or
        # when it ends without ever running.
        return f"{request_id}/0" not in self._stats.waiting_ids

    def _count_cache_and_preemptions(self, now: float) -> None:
        m, stats = self.metrics, self._stats
        m.prefix_queries.inc(stats.prefix_queries - self._seen_queries)
        m.prefix_hits.inc(stats.prefix_hits - self._seen_hits)
        self._seen_queries, self._seen_hits = stats.prefix_queries, stats.prefix_hits
        for mode, total in stats.num_preemptions.items():
            fresh = total - self._seen_preemptions[mode]
            if fresh:
                m.preemptions[mode].inc(fresh)
                self._unreported[mode] += fresh
                self._seen_preemptions[mode] = total
        if any(self._unreported.values()) and (
            now - self._last_warning >= PREEMPTION_WARNING_INTERVAL_S
        ):
            self._last_warning = now
            counts = ", ".join(f"{mode.value}={n}" for mode, n in self._unreported.items())
            totals = ", ".join(f"{mode.value}={n}" for mode, n in stats.num_preemptions.items())
            logger.warning(
                "KV cache full: preempted %s since the last warning (total %s); running=%d "
                "waiting=%d swapped=%d kv_usage=%.2f. Sustained preemption means overload: "
                "add replicas or KV memory, or lower --max-num-seqs",
                counts,
                totals,
                stats.num_running,
                stats.num_waiting,
                stats.num_swapped,
                stats.pool.usage,
            )
            self._unreported = dict.fromkeys(PreemptionMode, 0)

    @staticmethod
    def _log_finished(request_id: str, line: _Timeline, reason: FinishReason, now: float) -> None:
        ttft = "-" if line.first_token is None else f"{line.first_token - line.arrival:.3f}s"
        logger.info(
            "request %s finished: reason=%s prompt_tokens=%d generation_tokens=%d ttft=%s "
            "e2e=%.3fs",
            request_id,
            reason,
            line.num_prompt_tokens,
            sum(line.seen.values()),
            ttft,
            now - line.arrival,
        )


class GcPauses:
    """Every pause of Python's cyclic garbage collector, by generation, as
    ``quire_gc_pause_seconds{generation}``.

    A collection runs in whichever thread allocated past the threshold and holds the GIL
    throughout: a full (generation 2) collection stops the engine thread and every stream for as
    long as it takes to traverse the heap. ``serve`` freezes the startup heap so that full
    collections only traverse what serving created; this metric is how an operator sees that it
    worked (and how a regression would show).

    Process-wide (``gc.callbacks``): the process that serves installs one and ``close``s it. The
    callback runs inside the collector, so it only reads a clock and observes."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        family = Histogram(
            "quire_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector (all threads stop), by generation.",
            ["model_name", "generation"],
            buckets=GC_PAUSE_BUCKETS,
            registry=registry,
        )
        self._by_generation = [family.labels(model_name, str(g)) for g in range(3)]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
