"""vLLM's metric names on a live server (``engine/vllm_metrics``): after the deterministic
workload of ``vllm_workload`` every ``vllm:*`` series equals its ``quire_*`` twin, the counters
count exactly the traffic, the exposition parses with one family per name and vLLM's types, and
``--no-vllm-metrics`` (``QUIRE_VLLM_METRICS``) leaves only the ``quire_*`` series."""

from __future__ import annotations

import argparse
import os
from collections import Counter

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quire_engine import cli
from quire_engine.server.cli import settings_from_args
from tests.engine_tests.live_server import Samples, serve, tiny_settings
from tests.engine_tests.vllm_workload import PREFIX_HIT_TOKENS, Workload

ENGINE = (("engine", "0"),)
# vLLM gauge or counter sample -> the quire_* samples it adds up (docs/metrics.md).
PLAIN_TWINS = {
    "vllm:num_requests_running": ("quire_num_requests_running",),
    "vllm:num_requests_waiting": ("quire_num_requests_waiting", "quire_num_requests_swapped"),
    "vllm:kv_cache_usage_perc": ("quire_kv_cache_usage_ratio",),
    "vllm:prefix_cache_queries_total": ("quire_prefix_cache_queries_total",),
    "vllm:prefix_cache_hits_total": ("quire_prefix_cache_hits_total",),
    "vllm:num_preemptions_total": ("quire_preemptions_total",),
    "vllm:prompt_tokens_total": ("quire_prompt_tokens_total",),
    "vllm:prompt_tokens_cached_total": ("quire_prompt_tokens_cached_total",),
    "vllm:generation_tokens_total": ("quire_generation_tokens_total",),
}
# vLLM histogram -> the quire_* histogram with the same observations (other buckets).
HISTOGRAM_TWINS = {
    "vllm:time_to_first_token_seconds": "quire_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "quire_inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds": "quire_request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "quire_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "quire_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "quire_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "quire_request_decode_time_seconds",
    "vllm:request_inference_time_seconds": "quire_request_inference_time_seconds",
    "vllm:request_prompt_tokens": "quire_request_prompt_tokens",
    "vllm:request_generation_tokens": "quire_request_generation_tokens",
    "vllm:request_max_num_generation_tokens": "quire_request_max_num_generation_tokens",
    "vllm:request_params_n": "quire_request_params_n",
    "vllm:request_params_max_tokens": "quire_request_params_max_tokens",
    "vllm:request_prefill_kv_computed_tokens": "quire_request_prefill_kv_computed_tokens",
    "vllm:iteration_tokens_total": "quire_iteration_tokens",
}
# Every vLLM family the server exposes, by the name prometheus_client's parser gives it.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
    **{name.removesuffix("_total"): "counter" for name in PLAIN_TWINS if name.endswith("_total")},
    "vllm:request_success": "counter",
    **dict.fromkeys(HISTOGRAM_TWINS, "histogram"),
}


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of ``name`` by its labels other than ``model_name`` and ``engine``."""
    return {
        tuple(kv for kv in labels if kv[0] != "engine"): value
        for (sample, labels), value in samples.items()
        if sample == name
    }


def total(samples: Samples, *names: str) -> float:
    return sum(sum(series(samples, name).values()) for name in names)


def test_every_vllm_series_equals_its_quire_twin(vllm_workload: Workload) -> None:
    samples = vllm_workload.samples
    for name, twins in PLAIN_TWINS.items():
        assert len(series(samples, name)) == 1, name
        assert total(samples, name) == total(samples, *twins), name
    success = series(samples, "vllm:request_success_total")
    assert success == series(samples, "quire_request_success_total")
    for name, twin in HISTOGRAM_TWINS.items():
        # One measurement: count and sum are the same numbers (same unit, no tolerance needed).
        count = total(samples, f"{name}_count")
        assert count == total(samples, f"{twin}_count") > 0, name
        assert total(samples, f"{name}_sum") == total(samples, f"{twin}_sum"), name
        buckets = series(samples, f"{name}_bucket")
        cumulative = [v for labels, v in sorted(buckets.items(), key=lambda kv: _le(kv[0]))]
        assert cumulative == sorted(cumulative) and cumulative[-1] == count, name
    # Every vLLM series but the two info gauges carries model_name and engine="0".
    for (name, labels), _ in samples.items():
        if name.startswith("vllm:") and not name.endswith("_info"):
            assert ENGINE[0] in labels, name


def test_counters_count_exactly_the_traffic(vllm_workload: Workload) -> None:
    w, samples = vllm_workload, vllm_workload.samples

    def value(name: str) -> float:
        return total(samples, name)

    assert value("vllm:prompt_tokens_total") == w.prompt_tokens
    assert value("vllm:generation_tokens_total") == w.completion_tokens
    for reason, count in w.finished.items():
        labels = (("finished_reason", reason),)
        assert series(samples, "vllm:request_success_total")[labels] == count, reason
    assert value("vllm:num_preemptions_total") >= 1  # the forced one
    # Only first lookups count: every prompt once, and only the shared prefix hit.
    assert value("vllm:prefix_cache_queries_total") == w.prompt_tokens
    assert value("vllm:prefix_cache_hits_total") == PREFIX_HIT_TOKENS
    assert value("vllm:prompt_tokens_cached_total") == PREFIX_HIT_TOKENS
    finished = sum(w.finished.values())
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert value(f"vllm:{name}_count") == finished, name
    assert value("vllm:request_queue_time_seconds_count") == finished
    assert value("vllm:request_prompt_tokens_sum") == w.prompt_tokens
    assert value("vllm:request_generation_tokens_sum") == w.completion_tokens
    assert value("vllm:request_max_num_generation_tokens_sum") == w.longest_sum
    assert value("vllm:request_params_n_sum") == w.n_sum
    assert value("vllm:request_params_max_tokens_sum") == w.max_tokens_sum
    computed = w.prompt_tokens - PREFIX_HIT_TOKENS
    assert value("vllm:request_prefill_kv_computed_tokens_sum") == computed
    # Every token after a sample's first is one inter-token gap; a step reports the prompts
    # that got their first token plus the tokens generated.
    assert value("vllm:inter_token_latency_seconds_count") == w.completion_tokens - (
        w.samples_generated
    )
    assert value("vllm:iteration_tokens_total_sum") == w.prompt_tokens + w.completion_tokens
    # The one-token request has no time per output token.
    assert value("vllm:request_time_per_output_token_seconds_count") == finished - 1
    cache = series(samples, "vllm:cache_config_info")
    ((info, one),) = cache.items()
    assert one == 1 and dict(info)["num_gpu_blocks"] == "8" and dict(info)["block_size"] == "16"
    assert dict(info)["num_prefix_blocks"] == "8"  # no host tier: the device pool alone


def test_the_exposition_parses_with_one_family_per_name(vllm_workload: Workload) -> None:
    families = list(text_string_to_metric_families(vllm_workload.text))
    names = Counter(family.name for family in families)
    assert [name for name, n in names.items() if n > 1] == []
    types = {family.name: family.type for family in families if family.name.startswith("vllm:")}
    assert types == VLLM_TYPES
    lines = vllm_workload.text.splitlines()
    for prefix in ("# HELP ", "# TYPE "):
        declared = Counter(line.split()[2] for line in lines if line.startswith(prefix))
        assert [name for name, n in declared.items() if n > 1] == [], prefix


def test_no_vllm_metrics_exports_quire_series_only() -> None:
    with serve(tiny_settings(vllm_metrics=False)) as server, server.client() as client:
        client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
        server.wait_until_idle()
        text = httpx2.get(f"{server.url}/metrics").text
    assert "vllm:" not in text
    assert 'quire_request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    assert "quire_request_prefill_time_seconds_count" in text


def test_serve_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("QUIRE_")]:
        monkeypatch.delenv(name)

    def parse(*argv: str) -> argparse.Namespace:
        return cli.build_parser(["serve", *argv]).parse_args(["serve", *argv])

    assert settings_from_args(parse()).vllm_metrics is True
    assert settings_from_args(parse("--no-vllm-metrics")).vllm_metrics is False
    monkeypatch.setenv("QUIRE_VLLM_METRICS", "false")
    assert settings_from_args(parse()).vllm_metrics is False
    assert settings_from_args(parse("--vllm-metrics")).vllm_metrics is True  # the flag wins
    monkeypatch.setenv("QUIRE_VLLM_METRICS", "maybe")
    with pytest.raises(SystemExit):
        parse()


def _le(labels: tuple[tuple[str, str], ...]) -> float:
    return float(dict(labels)["le"])
