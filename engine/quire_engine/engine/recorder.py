"""``StatsRecorder``: turns engine steps into metric updates and log lines.

Owned by the engine thread (see ``async_engine``): it is the only writer of ``ServerMetrics``,
and it is handed a ``SchedulerStats`` snapshot taken on that thread right after a step or after
commands were applied, so the gauges describe a consistent state, and it never holds the live
scheduler. prometheus-client's own locks (and ``BatchHistogram``'s) make the scrape from the
event-loop thread safe. The recorder also writes the one log line per finished request and the
(rate-limited) preemption warnings.

A request's timeline, all ``time.monotonic()`` seconds taken on the engine thread: ``arrival``
(the HTTP request arrived), first scheduled (the start of the step in which it left the waiting
queue), first token and each sample's last token (the end of the step that produced them), and
its end. Queue, prefill, decode and inference times are differences of these (vLLM's phases).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from quire_engine.core.config import PreemptionMode
from quire_engine.core.host_tier import HostTierStats
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.sequence import FinishReason
from quire_engine.core.stats import SchedulerStats
from quire_engine.engine.metrics import EngineFacts, ServerMetrics, TransferType
from quire_engine.engine.vllm_metrics import LoRAState

logger = logging.getLogger(__name__)

# A warning per preemption would flood the log exactly when the server is overloaded.
PREEMPTION_WARNING_INTERVAL_S = 10.0


@dataclass(slots=True)
class _Timeline:
    """What the recorder remembers of one live engine request (one prompt)."""

    arrival: float
    num_prompt_tokens: int
    n: int
    max_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    last_token: dict[int, float] = field(default_factory=dict)  # per sample index
    seen: dict[int, int] = field(default_factory=dict)  # tokens already counted, per sample
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)


_NO_TIER = HostTierStats(0, 0, 0, 0, 0, 0, 0)


class StatsRecorder:
    """Turns engine steps into metric updates and log lines. Engine thread only."""

    def __init__(self, metrics: ServerMetrics, stats: SchedulerStats, facts: EngineFacts) -> None:
        self.metrics = metrics
        metrics.engine_ready(facts)
        self._stats = stats
        self._live: dict[str, _Timeline] = {}
        self._queued: dict[str, _Timeline] = {}  # live and never scheduled yet
        # Counters in the scheduler and the pool are cumulative (and include the warmup request):
        # only their growth since the last look is added to the Prometheus counters.
        self._seen_preemptions = dict(stats.num_preemptions)
        self._seen_queries = stats.prefix_queries
        self._seen_hits = stats.prefix_hits
        self._seen_host = stats.host or _NO_TIER
        self._bytes_per_block = facts.kv_bytes_per_block
        if stats.host is not None:
            metrics.offload_capacity.set(stats.host.capacity)
            metrics.offload_capacity_bytes.set(stats.host.capacity * facts.kv_bytes_per_block)
        self._unreported: dict[PreemptionMode, int] = dict.fromkeys(PreemptionMode, 0)
        self._last_warning = float("-inf")
        self._lora = LoRAState(0, {}, (), ())
        self.refresh(stats)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def added(
        self,
        request_id: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        arrival: float,
        lora_name: str | None = None,
    ) -> None:
        line = _Timeline(arrival, num_prompt_tokens, params.n, params.max_tokens)
        self._live[request_id] = self._queued[request_id] = line
        if lora_name is not None:
            line.lora_name = lora_name
            m = self.metrics
            m.lora_requests.labels(m.model_name, lora_name).inc()
            m.lora_prompt_tokens.labels(m.model_name, lora_name).inc(num_prompt_tokens)

    def adapters(self, max_lora: int, names: Mapping[int, str]) -> None:
        """The adapters served changed (loaded, unloaded) or the engine started."""
        self._lora = self._lora._replace(max_lora=max_lora, names=dict(names))
        self.metrics.lora_state(self._lora)

    def _lora_tokens(self, line: _Timeline) -> None:
        if line.lora_name is not None:
            m = self.metrics
            tokens = sum(line.seen.values())
            m.lora_generation_tokens.labels(m.model_name, line.lora_name).inc(tokens)

    def aborted(self, request_id: str, now: float) -> None:
        self._queued.pop(request_id, None)
        line = self._live.pop(request_id, None)
        if line is not None:
            self._lora_tokens(line)
            self.metrics.success(FinishReason.ABORT).inc()
            self._log_finished(request_id, line, FinishReason.ABORT, now)

    def step(
        self, outputs: list[RequestOutput], start: float, end: float, stats: SchedulerStats
    ) -> None:
        """Account for one ``engine.step()`` that ran from ``start`` to ``end``, after which the
        scheduler's state was ``stats``; also refreshes the gauges from it."""
        self._stats = stats
        m = self.metrics
        if self._queued:
            progressed = {out.request_id for out in outputs}
            for rid in [r for r in self._queued if r in progressed or self._left_queue(r)]:
                scheduled = self._queued.pop(rid)
                scheduled.scheduled = start
                m.queue_time.observe(max(0.0, start - scheduled.arrival))
        # Once per request per step: counters and the inter-token histogram are added up here
        # and applied once per step.
        itl: dict[float, int] = {}
        generated = prompts = cached = 0
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
                line.num_cached_tokens = max(out.num_cached_tokens, 0)
                cached += line.num_cached_tokens
            generated += new_tokens
            if out.finished:
                del self._live[out.request_id]
                reason = (
                    out.outputs[0].finish_reason if out.outputs else None
                ) or FinishReason.ABORT
                self._finished(line, reason, end)
                self._log_finished(out.request_id, line, reason, end)
        if itl:
            m.itl.observe_many(itl)
        if generated:
            m.generation_tokens.inc(generated)
        if prompts:
            m.prompt_tokens.inc(prompts)
            if cached:
                m.prompt_tokens_cached.inc(cached)
        m.iteration_tokens.observe(prompts + generated)
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
        if stats.host is not None:
            m.offload_used.set(stats.host.used)
            m.offload_usage.set(stats.host.usage)
        lora = self._lora._replace(running=stats.running_loras, waiting=stats.waiting_loras)
        if lora != self._lora:
            self._lora = lora
            m.lora_state(lora)

    def _finished(self, line: _Timeline, reason: FinishReason, end: float) -> None:
        """The per-request series of a request that finished in a step (an abort between steps
        only counts in ``quire_request_success_total``)."""
        m = self.metrics
        self._lora_tokens(line)
        m.success(reason).inc()
        m.e2e.observe(end - line.arrival)
        longest = max(line.seen.values(), default=0)
        m.request_prompt_tokens.observe(line.num_prompt_tokens)
        m.request_generation_tokens.observe(sum(line.seen.values()))
        m.request_max_generation_tokens.observe(longest)
        m.request_n.observe(line.n)
        m.request_max_tokens.observe(line.max_tokens)
        m.request_computed_tokens.observe(line.num_prompt_tokens - line.num_cached_tokens)
        first = line.first_token
        if first is None:  # failed before its first token
            return
        scheduled = first if line.scheduled is None else line.scheduled
        last = max(line.last_token.values())
        m.prefill_time.observe(first - scheduled)
        m.decode_time.observe(last - first)
        m.inference_time.observe(last - scheduled)
        if longest > 1:
            m.time_per_output_token.observe((last - first) / (longest - 1))

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
        host, seen = stats.host, self._seen_host
        if host is not None:
            m.host_queries.inc(host.queries - seen.queries)
            m.host_hits.inc(host.hits - seen.hits)
            m.offload_evictions.inc(host.dropped - seen.dropped)
            for kind, blocks in (
                (TransferType.OFFLOAD, host.offloaded - seen.offloaded),
                (TransferType.LOAD, host.loaded - seen.loaded),
            ):
                m.offload_blocks[kind].inc(blocks)
                m.offload_bytes[kind].inc(blocks * self._bytes_per_block)
            self._seen_host = host
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
