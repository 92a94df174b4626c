"""vLLM's metric names on Quire's ``/metrics``: the ``vllm:*`` series that routers (the Gateway API
Inference Extension's endpoint picker), vLLM dashboards, KEDA recipes and benchmark tools read.

Every ``vllm:*`` series is a second name for data Quire already keeps under a ``quire_*`` name
(its "twin"), never a second measurement, so both always agree and serving pays for one:

* gauges and counters (``DERIVED``) are computed at scrape time by ``VllmCollector`` from the
  ``quire_*`` metric objects, so the engine thread does no extra work for them;
* histograms are ``BatchHistogram`` exposures: the ``quire_*`` histogram's observations are also
  counted into vLLM's bucket bounds (``VllmHistogram``), in the same call and under the same lock;
* ``vllm:cache_config_info`` and ``vllm:lora_requests_info`` are info-style gauges (value 1, the
  data in the labels) describing the pool and the (absent) LoRA adapters.

Names, types, units and label sets follow vLLM's v1 engine (``vllm/v1/metrics/loggers.py``):
every series carries ``model_name`` and ``engine`` (always "0": one engine core per server),
except the two info gauges, which carry exactly vLLM's labels for them.

Ownership: this module only declares; ``metrics.ServerMetrics`` builds the objects, the engine
thread writes through the ``quire_*`` objects, scrapes read.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from quire_engine.core.config import CacheConfig

ENGINE_INDEX = "0"  # vLLM's ``engine`` label: the data-parallel engine core; Quire has one

# vLLM's bucket bounds (seconds): time to first token; inter-token latency and per-request time
# per output token; the per-request phase latencies (end to end, queue, prefill, decode,
# inference); tokens per engine step; and the ``n`` parameter.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0),
)
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


class Kind(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"


class Derived(NamedTuple):
    """A vLLM gauge or counter computed from ``quire_*`` samples: the sum of the ``sources``
    samples (over all their labels but ``keep``, which is carried over). ``name`` is the family
    name as vLLM declares it: a counter's sample is ``name + "_total"``."""

    name: str
    kind: Kind
    documentation: str
    sources: tuple[str, ...]
    keep: str | None = None
    note: str = ""
    needs_tier: bool = False  # exported only with a host tier, as vLLM's only with a connector


class VllmHistogram(NamedTuple):
    """vLLM's name, help text and bucket bounds for a ``quire_*`` histogram's measurement
    (``()``: 1, 2, 5, 10, ... up to ``max_model_len``, set once the engine is loaded)."""

    name: str
    documentation: str
    bounds: tuple[float, ...]
    note: str = ""


class Twin(NamedTuple):
    """For the reference: a ``vllm:*`` family, its type and the ``quire_*`` series carrying the
    same data (summed when several; none for the info gauges), and how they relate."""

    vllm: str
    kind: str
    quire: tuple[str, ...]
    note: str


DERIVED = (
    Derived(
        "vllm:num_requests_running",
        Kind.GAUGE,
        "Sequences running on the device (in the model's batches).",
        ("quire_num_requests_running",),
    ),
    Derived(
        "vllm:num_requests_waiting",
        Kind.GAUGE,
        "Sequences waiting to run: queued, preempted or swapped out.",
        ("quire_num_requests_waiting", "quire_num_requests_swapped"),
        note="vLLM's waiting queue also holds preempted requests (its engine does not swap).",
    ),
    Derived(
        "vllm:kv_cache_usage_perc",
        Kind.GAUGE,
        "Used KV blocks / total blocks, 0 to 1 (1 means 100 percent).",
        ("quire_kv_cache_usage_ratio",),
    ),
    Derived(
        "vllm:prefix_cache_queries",
        Kind.COUNTER,
        "Prompt tokens looked up in the prefix cache when a request is first scheduled.",
        ("quire_prefix_cache_queries_total",),
    ),
    Derived(
        "vllm:prefix_cache_hits",
        Kind.COUNTER,
        "Prompt tokens found in the prefix cache when a request is first scheduled.",
        ("quire_prefix_cache_hits_total",),
        note="Host-tier hits included (Quire's tier is part of its prefix cache); vLLM counts its "
        "KV connector's hits in vllm:external_prefix_cache_hits only.",
    ),
    Derived(
        "vllm:external_prefix_cache_queries",
        Kind.COUNTER,
        "Prompt tokens looked up in the host tier after the device pool missed them, when a "
        "request is first scheduled.",
        ("quire_prefix_cache_host_queries_total",),
        note="Quire's host tier (--kv-offloading-size) stands where vLLM's KV connector does; "
        "exported only with a tier, as vLLM exports it only with a connector.",
        needs_tier=True,
    ),
    Derived(
        "vllm:external_prefix_cache_hits",
        Kind.COUNTER,
        "Prompt tokens found in the host tier and copied back, when a request is first scheduled.",
        ("quire_prefix_cache_host_hits_total",),
        note="Only with a host tier.",
        needs_tier=True,
    ),
    Derived(
        "vllm:kv_offload_total_bytes",
        Kind.COUNTER,
        "Bytes copied between the device pool and the host tier, by transfer_type (GPU_to_CPU, "
        "CPU_to_GPU).",
        ("quire_kv_offload_bytes_total",),
        keep="transfer_type",
        note="vLLM's OffloadingConnector counter; GPU names the device pool on any device. "
        "Only with a host tier.",
        needs_tier=True,
    ),
    Derived(
        "vllm:num_preemptions",
        Kind.COUNTER,
        "Sequences preempted because the KV pool ran dry (recompute and swap).",
        ("quire_preemptions_total",),
    ),
    Derived(
        "vllm:prompt_tokens",
        Kind.COUNTER,
        "Prompt tokens of requests that produced their first token.",
        ("quire_prompt_tokens_total",),
    ),
    Derived(
        "vllm:prompt_tokens_cached",
        Kind.COUNTER,
        "Prompt tokens served from the prefix cache, of requests that produced their first token.",
        ("quire_prompt_tokens_cached_total",),
    ),
    Derived(
        "vllm:generation_tokens",
        Kind.COUNTER,
        "Generated tokens.",
        ("quire_generation_tokens_total",),
    ),
    Derived(
        "vllm:request_success",
        Kind.COUNTER,
        "Finished requests by finish reason (stop, length, abort).",
        ("quire_request_success_total",),
        keep="finished_reason",
    ),
)

# By the quire_* histogram whose observations they share.
HISTOGRAMS = {
    "quire_time_to_first_token_seconds": VllmHistogram(
        "vllm:time_to_first_token_seconds", "Arrival to first token (seconds).", TTFT_BUCKETS
    ),
    "quire_inter_token_latency_seconds": VllmHistogram(
        "vllm:inter_token_latency_seconds",
        "Time between two tokens of a sample (seconds).",
        TOKEN_LATENCY_BUCKETS,
    ),
    "quire_request_time_per_output_token_seconds": VllmHistogram(
        "vllm:request_time_per_output_token_seconds",
        "Per request: decode time / (output tokens - 1) (seconds).",
        TOKEN_LATENCY_BUCKETS,
    ),
    "quire_e2e_request_latency_seconds": VllmHistogram(
        "vllm:e2e_request_latency_seconds",
        "Per finished request: arrival to last token (seconds).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "quire_request_queue_time_seconds": VllmHistogram(
        "vllm:request_queue_time_seconds",
        "Per request: arrival to first scheduled (seconds).",
        REQUEST_LATENCY_BUCKETS,
        note="Observed when the request is first scheduled; vLLM observes it when it finishes.",
    ),
    "quire_request_prefill_time_seconds": VllmHistogram(
        "vllm:request_prefill_time_seconds",
        "Per request: first scheduled to first token (seconds).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "quire_request_decode_time_seconds": VllmHistogram(
        "vllm:request_decode_time_seconds",
        "Per request: first token to last token (seconds).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "quire_request_inference_time_seconds": VllmHistogram(
        "vllm:request_inference_time_seconds",
        "Per request: first scheduled to last token (seconds).",
        REQUEST_LATENCY_BUCKETS,
    ),
    "quire_request_prompt_tokens": VllmHistogram(
        "vllm:request_prompt_tokens", "Per finished request: prompt tokens.", ()
    ),
    "quire_request_generation_tokens": VllmHistogram(
        "vllm:request_generation_tokens",
        "Per finished request: generated tokens (all samples).",
        (),
        note="Per request with all its n samples; vLLM counts each sample as a request.",
    ),
    "quire_request_max_num_generation_tokens": VllmHistogram(
        "vllm:request_max_num_generation_tokens",
        "Per finished request: generated tokens of its longest sample.",
        (),
    ),
    "quire_request_params_n": VllmHistogram(
        "vllm:request_params_n", "Per finished request: the n parameter.", PARAMS_N_BUCKETS
    ),
    "quire_request_params_max_tokens": VllmHistogram(
        "vllm:request_params_max_tokens",
        "Per finished request: the max_tokens parameter.",
        (),
    ),
    "quire_request_prefill_kv_computed_tokens": VllmHistogram(
        "vllm:request_prefill_kv_computed_tokens",
        "Per finished request: prompt tokens computed, not served from the prefix cache.",
        (),
    ),
    "quire_iteration_tokens": VllmHistogram(
        "vllm:iteration_tokens_total",
        "Per engine step: prompt tokens of requests that got their first token plus generated "
        "tokens.",
        ITERATION_TOKEN_BUCKETS,
    ),
}

CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
INFO_TWINS = (
    Twin(
        CACHE_CONFIG_INFO,
        "gauge",
        (),
        "Labels: block_size, num_gpu_blocks (quire_kv_blocks_capacity), num_cpu_blocks, "
        "cache_dtype, enable_prefix_caching, gpu_memory_utilization, swap_space, sliding_window "
        "and engine, written as vLLM writes them; present once the engine is loaded. Quire adds "
        "num_prefix_blocks: the blocks whose prefixes it serves without recompute (the device "
        "pool plus the host tier), for a router's per-replica prefix index.",
    ),
    Twin(
        LORA_REQUESTS_INFO,
        "gauge",
        (),
        "One series: max_lora (the adapter slots of a step, 0 without LoRA), "
        "running_lora_adapters and waiting_lora_adapters (the names of the adapters of the "
        "running and the waiting requests, comma-separated); the value is the time of the "
        "report. vLLM exports it only when it serves LoRA adapters; Quire always does, so that "
        "the endpoint picker, which reads it by default, finds it.",
    ),
)


class LoRAState(NamedTuple):
    """What ``vllm:lora_requests_info`` reports: the step's adapter slots, every adapter's
    name by lora id, and the adapters of the running and the waiting requests."""

    max_lora: int
    names: Mapping[int, str]
    running: tuple[int, ...]
    waiting: tuple[int, ...]

    def labels(self) -> list[str]:
        """max_lora, waiting_lora_adapters, running_lora_adapters (vLLM's label order)."""

        def joined(ids: tuple[int, ...]) -> str:
            return ",".join(self.names.get(i, str(i)) for i in ids)

        return [str(self.max_lora), joined(self.waiting), joined(self.running)]


class _Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def cache_config_labels(
    cache: CacheConfig, gpu_memory_utilization: float, swap_space: float
) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: the fields of vLLM's ``CacheConfig`` Quire has, as
    vLLM writes them (``str`` of the value); ``cache_dtype`` is ``--kv-cache-dtype`` (``auto``:
    the model's dtype).

    ``num_prefix_blocks`` is Quire's: device blocks plus host-tier blocks, what a replica's prefix
    cache holds. The Endpoint Picker sizes its per-replica prefix index from a label of this
    series (``num_gpu_blocks`` unless configured otherwise); with a tier the operator points it
    here, so the index does not forget prefixes the replica still serves from host memory."""
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": cache.kv_cache_dtype.value,
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "num_cpu_blocks": str(cache.num_cpu_blocks),
        "num_gpu_blocks": str(cache.num_blocks),
        "num_prefix_blocks": str((cache.num_blocks or 0) + cache.num_host_blocks),
        "sliding_window": str(cache.sliding_window),
        "swap_space": str(swap_space),
        "engine": ENGINE_INDEX,
    }


class VllmCollector:
    """The ``DERIVED`` gauges and counters and the two info gauges, computed at scrape time.

    ``sources`` are the ``quire_*`` metric objects (read through their public ``collect``); a
    scrape sums their samples per ``Derived``. ``set_cache_config`` is called once, by the engine
    thread, when the engine is loaded."""

    def __init__(self, model_name: str, sources: Iterable[_Collector]) -> None:
        self.model_name = model_name
        self._sources = list(sources)
        self._cache_labels: Mapping[str, str] | None = None
        self._host_tier = False
        self._lora = LoRAState(0, {}, (), ())
        self._lock = threading.Lock()

    def set_lora(self, state: LoRAState) -> None:
        with self._lock:
            self._lora = state

    @property
    def lora(self) -> LoRAState:
        with self._lock:
            return self._lora

    def set_cache_config(self, labels: Mapping[str, str], *, host_tier: bool = False) -> None:
        """``host_tier``: the engine has one, so the series that need it are exported."""
        with self._lock:
            self._cache_labels = dict(labels)
            self._host_tier = host_tier

    def collect(self) -> Iterable[Metric]:
        totals = self._totals()
        families: list[Metric] = []
        with self._lock:
            host_tier = self._host_tier
        for d in DERIVED:
            if d.needs_tier and not host_tier:
                continue
            labels = ["model_name", "engine", *([d.keep] if d.keep else [])]
            family: GaugeMetricFamily | CounterMetricFamily
            if d.kind is Kind.GAUGE:
                family = GaugeMetricFamily(d.name, d.documentation, labels=labels)
            else:
                family = CounterMetricFamily(d.name, d.documentation, labels=labels)
            sums: dict[str, float] = {}
            for source in d.sources:
                for kept, value in totals.get(source, {}).items():
                    sums[kept] = sums.get(kept, 0.0) + value
            for kept, value in sums.items():
                values = [self.model_name, ENGINE_INDEX, *([kept] if d.keep else [])]
                family.add_metric(values, value)
            families.append(family)
        return families + self._info()

    def _totals(self) -> dict[str, dict[str, float]]:
        """sample name -> value of its kept label ("" when none is kept) -> sum of the samples."""
        kept_label = {source: d.keep for d in DERIVED if d.keep for source in d.sources}
        totals: dict[str, dict[str, float]] = {}
        for source in self._sources:
            for family in source.collect():
                for sample in family.samples:
                    label = kept_label.get(sample.name)
                    kept = sample.labels.get(label, "") if label else ""
                    per_kept = totals.setdefault(sample.name, {})
                    per_kept[kept] = per_kept.get(kept, 0.0) + sample.value
        return totals

    def _info(self) -> list[Metric]:
        with self._lock:
            cache, adapters = self._cache_labels, self._lora
        info = GaugeMetricFamily(
            CACHE_CONFIG_INFO,
            "Configuration of the KV pool, in the labels (value 1).",
            labels=list(cache) if cache is not None else None,
        )
        if cache is not None:
            info.add_metric(list(cache.values()), 1.0)
        lora = GaugeMetricFamily(
            LORA_REQUESTS_INFO,
            "LoRA adapters running and waiting, in the labels; the value is the time of the "
            "report.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        lora.add_metric(adapters.labels(), time.time())
        return [info, lora]


def twins(histograms: Iterable[tuple[str, VllmHistogram]]) -> list[Twin]:
    """Every ``vllm:*`` family with its ``quire_*`` twin, in exposition order of the kinds:
    histograms (given as (quire name, spec) pairs, in registration order), then the derived gauges
    and counters, then the info gauges."""
    out = [Twin(v.name, "histogram", (quire,), v.note) for quire, v in histograms]
    out += [Twin(d.name, d.kind.value, d.sources, d.note) for d in DERIVED]
    return out + list(INFO_TWINS)
