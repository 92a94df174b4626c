"""What the two main readers of vLLM's series get from our ``/metrics``:

* the Gateway API Inference Extension's endpoint picker (EPP) v1.5.0, whose default mapping for
  engine "vllm" reads five series; ``epp_view`` follows its extraction
  (pkg/epp/framework/plugins/datalayer/extractor/metrics/extractor.go, spec.go, loraspec.go);
* inference-perf's Prometheus report for server type ``vllm``: every series it queries that Quire
  exports exists and is non-zero after traffic (gauges: while requests run and wait).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Literal, NamedTuple, TypedDict

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.engine_tests.live_server import RunningServer, serve, tiny_settings
from tests.engine_tests.vllm_workload import POOL, Workload

# inference-perf 0.7.0, inference_perf/client/modelserver/vllm_client.py
# (vLLMModelServerClient.get_prometheus_metric_metadata), by its metric kind. A counter is
# queried as `name_total` or `name`, a histogram as `name_sum`, `name_count`, `name_bucket`.
INFERENCE_PERF_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)
INFERENCE_PERF_COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:prompt_tokens_cached",
)
INFERENCE_PERF_HISTOGRAMS = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_prefill_kv_computed_tokens",
)
# The rest of that list: series vLLM itself only has with a feature Quire does not have.
INFERENCE_PERF_NOT_EXPORTED = {
    # Quire has them with a host tier (--kv-offloading-size; test_host_tier_server), which
    # this workload's server has not, as vLLM has them only with a KV connector.
    "vllm:external_prefix_cache_hits": "a KV connector (cross-instance cache)",
    "vllm:external_prefix_cache_queries": "a KV connector (cross-instance cache)",
    "vllm:mm_cache_hits": "multimodal inputs",
    "vllm:mm_cache_queries": "multimodal inputs",
    "vllm:corrupted_requests": "VLLM_COMPUTE_NANS_IN_LOGITS=1",
    "vllm:kv_block_idle_before_evict_seconds": "--kv-cache-metrics",
    "vllm:kv_block_lifetime_seconds": "--kv-cache-metrics",
    "vllm:kv_block_reuse_gap_seconds": "--kv-cache-metrics",
}


class EppView(NamedTuple):
    """The endpoint picker's per-pod metrics (its ``fwkdl.Metrics`` fields)."""

    waiting_queue_size: int
    running_requests_size: int
    kv_cache_usage_percent: float
    active_models: frozenset[str]
    waiting_models: frozenset[str]
    max_active_models: int
    cache_block_size: int
    cache_num_blocks: int


def epp_view(text: str) -> EppView:
    """The EPP's extraction with its default "vllm" mapping. It parses the text format into
    families; a missing family or one without series is an error for that field; a gauge is read
    from its latest series (ours have one); the LoRA series is the one with the largest value;
    adapters are comma-separated label values, ``max_lora``, ``block_size`` and
    ``num_gpu_blocks`` go through Go's ``strconv.Atoi`` (plain decimal integers)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def only(name: str) -> Sample:
        samples = [s for s in families[name].samples if s.name == name]
        assert families[name].type == "gauge" and len(samples) == 1, name
        return samples[0]

    def atoi(value: str) -> int:
        assert value.isdigit(), value  # Atoi also takes a sign; vLLM writes none
        return int(value)

    def adapters(csv: str) -> frozenset[str]:
        return frozenset(a.strip() for a in csv.split(",") if a.strip())

    lora = max(families["vllm:lora_requests_info"].samples, key=lambda s: s.value).labels
    cache = only("vllm:cache_config_info").labels
    return EppView(
        int(only("vllm:num_requests_waiting").value),
        int(only("vllm:num_requests_running").value),
        only("vllm:kv_cache_usage_perc").value,
        adapters(lora["running_lora_adapters"]),
        adapters(lora["waiting_lora_adapters"]),
        atoi(lora["max_lora"]),
        atoi(cache["block_size"]),
        atoi(cache["num_gpu_blocks"]),
    )


class LongStream(TypedDict):
    """A streamed completion long enough to keep running while the test reads the metrics."""

    max_tokens: int
    stream: Literal[True]
    extra_body: dict[str, object]


@pytest.fixture(scope="module")
def busy_scrape() -> str:
    """/metrics while one request runs and one waits (``max_num_seqs`` 1): the first one is long
    enough (2000 tokens) to still run when the second is queued; both are then closed (aborted)
    and the server is idle again before any test runs."""
    settings = tiny_settings({"max_num_seqs": 1, "max_model_len": 2048, "num_blocks": 256})
    long: LongStream = {"max_tokens": 2000, "stream": True, "extra_body": {"ignore_eos": True}}
    with serve(settings) as server, server.client() as client:
        with ExitStack() as streams:
            first = client.completions.create(model="tiny", prompt="a", **long)
            next(iter(streams.enter_context(first)))  # it runs
            streams.enter_context(client.completions.create(model="tiny", prompt="b", **long))
            server.wait_until(lambda: _busy(server), "one request running, one waiting")
            text = httpx2.get(f"{server.url}/metrics").text
        server.wait_until_idle()
    return text


def _busy(server: RunningServer) -> bool:
    samples = server.metrics()
    return (
        samples[("quire_num_requests_running", ())] == 1
        and samples[("quire_num_requests_waiting", ())] == 1
    )


def test_the_endpoint_picker_reads_our_series(vllm_workload: Workload, busy_scrape: str) -> None:
    idle = epp_view(vllm_workload.text)
    assert idle == EppView(0, 0, 0.0, frozenset(), frozenset(), 0, 16, POOL["num_blocks"])
    busy = epp_view(busy_scrape)
    assert (busy.waiting_queue_size, busy.running_requests_size) == (1, 1)
    assert 0 < busy.kv_cache_usage_percent < 1
    assert (busy.cache_block_size, busy.cache_num_blocks) == (16, 256)


def test_every_series_inference_perf_reads_is_non_zero_after_traffic(
    vllm_workload: Workload, busy_scrape: str
) -> None:
    after = vllm_workload.samples

    def total(name: str) -> float:  # over all its series (one per finish reason, ...)
        return sum(value for (sample, _), value in after.items() if sample == name)

    during = {s.name: s.value for f in text_string_to_metric_families(busy_scrape)
              for s in f.samples}  # fmt: skip
    for name in INFERENCE_PERF_GAUGES:
        assert during[name] > 0, name
    for name in INFERENCE_PERF_COUNTERS:
        assert total(f"{name}_total") > 0, name
    for name in INFERENCE_PERF_HISTOGRAMS:
        assert total(f"{name}_count") > 0 and total(f"{name}_sum") > 0, name
    exposed = {f.name for f in text_string_to_metric_families(vllm_workload.text)}
    for name, needs in INFERENCE_PERF_NOT_EXPORTED.items():
        assert name not in exposed, f"{name} (vLLM has it only with {needs})"
