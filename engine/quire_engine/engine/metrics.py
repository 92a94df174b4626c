"""Prometheus metrics of the server, each declared once (the reference, docs/metrics.md, is
generated from this registry).

``ServerMetrics`` owns one ``CollectorRegistry`` per app (never the global one), so tests and
benchmarks can build several servers in one process. Every ``quire_*`` series carries
``model_name``. With ``vllm=True`` (the default) the registry also exposes vLLM's names for the
same data (``vllm_metrics``): routers, dashboards and benchmark tools written for vLLM read them
unchanged. ``StatsRecorder`` (``recorder``) is the only writer, on the engine thread.
"""

from __future__ import annotations

import enum
import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quire_engine.core.config import CacheConfig, PreemptionMode
from quire_engine.core.sequence import FinishReason
from quire_engine.core.stats import KV_DEMAND_OUTPUT_SHARE
from quire_engine.engine import vllm_metrics
from quire_engine.engine.histogram import BatchHistogram, Exposure, buckets_1_2_5
from quire_engine.engine.startup import StartupPhase
from quire_engine.engine.vllm_metrics import VllmCollector, VllmHistogram

if TYPE_CHECKING:
    from quire_engine.engine.llm_engine import LLMEngine

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
TOKEN_BUCKETS_DOC = " Buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."


class TransferType(enum.StrEnum):
    """The ``transfer_type`` label of the host tier's copy counters, as vLLM writes it (its
    ``vllm:kv_offload_total_bytes``); GPU is the device pool, whatever the device."""

    OFFLOAD = "GPU_to_CPU"  # an evicted prefix block into the host tier
    LOAD = "CPU_to_GPU"  # a host-tier hit back into the device pool


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the metrics need to know of the loaded engine: token counts are bucketed up to
    ``max_model_len``, and ``vllm:cache_config_info`` describes the pool."""

    max_model_len: int
    cache: CacheConfig
    gpu_memory_utilization: float
    swap_space: float
    startup: Mapping[StartupPhase, float] = field(default_factory=dict)  # seconds per phase
    kv_bytes_per_token: int = 0  # one token's K and V in every layer, scales included
    kv_scales: str = "none"  # none, dynamic or checkpoint (ModelRunner.kv_scales)
    # One block of every tensor-parallel rank: what a host-tier copy moves.
    kv_bytes_per_block: int = 0

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        cache = engine.scheduler.cache_config
        return cls(
            engine.max_model_len,
            cache,
            cache.gpu_memory_utilization,
            cache.swap_space,
            dict(engine.startup.seconds),
            engine.runner.shape.bytes_per_token,
            engine.runner.kv_scales,
            engine.runner.shape.bytes_per_block * engine.config.parallel.tensor_parallel_size,
        )


class ServerMetrics:
    """The metric objects, already bound to this server's ``model_name``."""

    def __init__(self, model_name: str, *, vllm: bool = True) -> None:
        self.model_name = model_name
        self.vllm = vllm
        self.registry = CollectorRegistry()
        self._plain: list[Gauge | Counter] = []  # what the vLLM gauges and counters read
        self._vllm_histograms: list[tuple[str, VllmHistogram]] = []
        self._token_histograms: list[BatchHistogram] = []  # bucketed up to max_model_len

        self.kv_usage = self._gauge(
            "quire_kv_cache_usage_ratio", "Used KV blocks / total blocks (0-1)."
        )
        self.kv_demand = self._gauge(
            "quire_kv_cache_demand_ratio",
            "(Used KV blocks + blocks unfinished requests still need for their known tokens and "
            f"{KV_DEMAND_OUTPUT_SHARE:g} of their remaining max_tokens) / total blocks; > 1 means "
            "queueing or preemption ahead.",
        )
        self.kv_blocks_capacity = self._gauge(
            "quire_kv_blocks_capacity", "KV blocks in the device pool."
        )
        self.kv_blocks_free = self._gauge(
            "quire_kv_blocks_free", "Unreferenced KV blocks (including cached prefixes)."
        )
        # Set once when the engine is ready; no vLLM twin (vllm:cache_config_info carries
        # cache_dtype only).
        self._kv_info = Gauge(
            "quire_kv_cache_info",
            "1, labelled with what the KV pool stores: cache_dtype (auto, fp8_e4m3, fp8_e5m2, "
            "int8; auto is the model's dtype), scales (none, dynamic: per token and KV head, "
            "checkpoint: the checkpoint's per-layer fp8 scales) and bytes_per_token (K and V "
            "of every layer, scales included).",
            ["model_name", "cache_dtype", "scales", "bytes_per_token"],
            registry=self.registry,
        )
        self.running = self._gauge("quire_num_requests_running", "Sequences running on the device.")
        self.waiting = self._gauge(
            "quire_num_requests_waiting", "Sequences waiting to be scheduled."
        )
        self.swapped = self._gauge("quire_num_requests_swapped", "Sequences swapped out to CPU.")
        self.lora_requests = self._counter_family(
            "quire_lora_requests_total",
            "Requests (prompts) admitted, per LoRA adapter.",
            "lora_name",
        )
        self.lora_prompt_tokens = self._counter_family(
            "quire_lora_prompt_tokens_total", "Prompt tokens, per LoRA adapter.", "lora_name"
        )
        self.lora_generation_tokens = self._counter_family(
            "quire_lora_generation_tokens_total",
            "Tokens generated for finished or aborted requests, per LoRA adapter.",
            "lora_name",
        )
        preemptions = self._counter_family(
            "quire_preemptions_total",
            "Sequences preempted because the KV pool ran dry.",
            "mode",
        )
        self.preemptions = {
            mode: preemptions.labels(model_name, mode.value) for mode in PreemptionMode
        }
        self.prefix_queries = self._counter(
            "quire_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache when a request is first scheduled (not "
            "again after a preemption, when a request mostly finds its own blocks).",
        )
        self.prefix_hits = self._counter(
            "quire_prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache when a request is first scheduled.",
        )
        # The host tier under the prefix cache (--kv-offloading-size): capacity, usage, hits and
        # copies, so that a router or autoscaler scores the tier from the engine.
        self.offload_capacity = self._gauge(
            "quire_kv_offload_blocks_capacity",
            "Blocks the host tier under the prefix cache holds at most (--kv-offloading-size; 0: "
            "no tier).",
        )
        self.offload_capacity_bytes = self._gauge(
            "quire_kv_offload_capacity_bytes",
            "Host memory the tier's blocks take when full, all tensor-parallel ranks together.",
        )
        self.offload_used = self._gauge(
            "quire_kv_offload_blocks_used", "Host-tier blocks holding a prefix."
        )
        self.offload_usage = self._gauge(
            "quire_kv_offload_usage_ratio",
            "Used host-tier blocks / capacity (0-1; 0 without a tier).",
        )
        self.host_queries = self._counter(
            "quire_prefix_cache_host_queries_total",
            "Prompt tokens looked up in the host tier because the device pool did not hold "
            "them, when a request is first scheduled.",
        )
        self.host_hits = self._counter(
            "quire_prefix_cache_host_hits_total",
            "Of those, tokens found in the host tier and copied back instead of recomputed "
            "(they count in quire_prefix_cache_hits_total too).",
        )
        offload_blocks = self._counter_family(
            "quire_kv_offload_blocks_total",
            "Blocks copied between the device pool and the host tier, by transfer_type "
            "(GPU_to_CPU: evicted prefixes into the tier, CPU_to_GPU: host hits back).",
            "transfer_type",
        )
        offload_bytes = self._counter_family(
            "quire_kv_offload_bytes_total",
            "Bytes copied between the device pool and the host tier, by transfer_type (as "
            "quire_kv_offload_blocks_total; 8-bit blocks with their scales).",
            "transfer_type",
        )
        self.offload_blocks = {t: offload_blocks.labels(model_name, t) for t in TransferType}
        self.offload_bytes = {t: offload_bytes.labels(model_name, t) for t in TransferType}
        self.offload_evictions = self._counter(
            "quire_kv_offload_evictions_total",
            "Prefixes the host tier dropped (least recently used) to make room for newer ones.",
        )
        self.prompt_tokens = self._counter(
            "quire_prompt_tokens_total",
            "Prompt tokens of requests that produced their first token.",
        )
        self.prompt_tokens_cached = self._counter(
            "quire_prompt_tokens_cached_total",
            "Of those, tokens served from the prefix cache (not computed).",
        )
        self.generation_tokens = self._counter("quire_generation_tokens_total", "Generated tokens.")
        self._success = self._counter_family(
            "quire_request_success_total",
            "Finished requests by finish reason (stop, length, abort).",
            "finished_reason",
        )
        for reason in FinishReason:  # export zeros before the first request
            self._success.labels(model_name, reason)

        self.ttft = self._histogram(
            "quire_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = self._histogram(
            "quire_inter_token_latency_seconds", "Time between tokens of a sample.", ITL_BUCKETS
        )
        self.time_per_output_token = self._histogram(
            "quire_request_time_per_output_token_seconds",
            "Per finished request with two tokens or more: decode time / (tokens of its longest "
            "sample - 1).",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "quire_e2e_request_latency_seconds",
            "Per finished request: arrival to last token.",
            E2E_BUCKETS,
        )
        self.queue_time = self._histogram(
            "quire_request_queue_time_seconds", "Arrival to first scheduled.", QUEUE_BUCKETS
        )
        self.prefill_time = self._histogram(
            "quire_request_prefill_time_seconds",
            "Per finished request: first scheduled to first token (preemptions included).",
            TTFT_BUCKETS,
        )
        self.decode_time = self._histogram(
            "quire_request_decode_time_seconds",
            "Per finished request: first token to last token (preemptions included).",
            E2E_BUCKETS,
        )
        self.inference_time = self._histogram(
            "quire_request_inference_time_seconds",
            "Per finished request: first scheduled to last token.",
            E2E_BUCKETS,
        )
        self.request_prompt_tokens = self._token_histogram(
            "quire_request_prompt_tokens", "Per finished request: prompt tokens."
        )
        self.request_generation_tokens = self._token_histogram(
            "quire_request_generation_tokens",
            "Per finished request: generated tokens (all its samples).",
        )
        self.request_max_generation_tokens = self._token_histogram(
            "quire_request_max_num_generation_tokens",
            "Per finished request: generated tokens of its longest sample.",
        )
        self.request_n = self._histogram(
            "quire_request_params_n",
            "Per finished request: the n parameter (parallel samples).",
            vllm_metrics.PARAMS_N_BUCKETS,
        )
        self.request_max_tokens = self._token_histogram(
            "quire_request_params_max_tokens", "Per finished request: the max_tokens parameter."
        )
        self.request_computed_tokens = self._token_histogram(
            "quire_request_prefill_kv_computed_tokens",
            "Per finished request: prompt tokens computed (not served from the prefix cache).",
        )
        self.iteration_tokens = self._histogram(
            "quire_iteration_tokens",
            "Per engine step: prompt tokens of the requests that got their first token plus the "
            "tokens generated (vLLM's definition).",
            vllm_metrics.ITERATION_TOKEN_BUCKETS,
        )
        # No vLLM twin: vLLM logs its start-up times but exports none.
        self._startup = Gauge(
            "quire_startup_seconds",
            "Seconds the engine took to start, by phase, set once when it is ready: imports "
            "(process start to serve starting its engine), model_cache (waiting for a shared "
            "model cache; only when it waits), weights (config, tokenizer and weights onto the "
            "device), kv_profile (sizing the KV pool), kv_allocate (the KV pool and the runner), "
            "warmup (one request through the engine), ready (process start to ready to serve; "
            "at least the sum of the others).",
            ["model_name", "phase"],
            registry=self.registry,
        )
        self.vllm_collector: VllmCollector | None = None
        if vllm:
            self.vllm_collector = VllmCollector(model_name, self._plain)
            self.registry.register(self.vllm_collector)

    def success(self, reason: FinishReason) -> Counter:
        return self._success.labels(self.model_name, reason)

    def engine_ready(self, facts: EngineFacts) -> None:
        """Called once, on the engine thread, when the engine is loaded and before it serves."""
        for phase, seconds in facts.startup.items():
            self._startup.labels(self.model_name, phase).set(seconds)
        kv = facts.cache.kv_cache_dtype.value, facts.kv_scales, str(facts.kv_bytes_per_token)
        self._kv_info.labels(self.model_name, *kv).set(1)
        bounds = buckets_1_2_5(facts.max_model_len)
        for histogram in self._token_histograms:
            histogram.set_bounds(bounds)
        if self.vllm_collector is not None:
            self.vllm_collector.set_cache_config(
                vllm_metrics.cache_config_labels(
                    facts.cache, facts.gpu_memory_utilization, facts.swap_space
                ),
                host_tier=facts.cache.num_host_blocks > 0,
            )

    def lora_state(self, state: vllm_metrics.LoRAState) -> None:
        """What ``vllm:lora_requests_info`` reports from now on (engine thread)."""
        if self.vllm_collector is not None:
            self.vllm_collector.set_lora(state)

    def vllm_twins(self) -> list[vllm_metrics.Twin]:
        """Every exposed ``vllm:*`` family with its ``quire_*`` twin (empty with ``vllm=False``)."""
        return vllm_metrics.twins(self._vllm_histograms) if self.vllm else []

    # ---- declaration helpers -------------------------------------------------------------
    def _gauge(self, name: str, doc: str) -> Gauge:
        family = Gauge(name, doc, ["model_name"], registry=self.registry)
        self._plain.append(family)
        return family.labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return self._counter_family(name, doc).labels(self.model_name)

    def _counter_family(self, name: str, doc: str, *labels: str) -> Counter:
        family = Counter(name, doc, ["model_name", *labels], registry=self.registry)
        self._plain.append(family)
        return family

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...], *, token_counts: bool = False
    ) -> BatchHistogram:
        exposures = [Exposure(name, doc, buckets, (("model_name", self.model_name),))]
        twin = vllm_metrics.HISTOGRAMS.get(name) if self.vllm else None
        if twin is not None:
            labels = (("model_name", self.model_name), ("engine", vllm_metrics.ENGINE_INDEX))
            twin_doc = twin.documentation + ("" if twin.bounds else TOKEN_BUCKETS_DOC)
            exposures.append(Exposure(twin.name, twin_doc, twin.bounds, labels))
            self._vllm_histograms.append((name, twin))
        histogram = BatchHistogram(exposures, self.registry)
        if token_counts:
            self._token_histograms.append(histogram)
        return histogram

    def _token_histogram(self, name: str, doc: str) -> BatchHistogram:
        return self._histogram(name, doc + TOKEN_BUCKETS_DOC, (), token_counts=True)


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
