"""The host tier seen from outside, with the official openai client: a prompt the device pool
evicted is reported cached in ``usage.prompt_tokens_details.cached_tokens`` because the tier held
it, and /metrics shows the tier's capacity, usage, hits and bytes copied each way, under Quire's
names and vLLM's."""

from __future__ import annotations

import random

from quire_engine.engine.metrics import TransferType
from tests.engine_tests.engine.test_host_tier_engine import tier_gib
from tests.engine_tests.live_server import serve, tiny_settings


def test_host_hits_are_cached_tokens_and_metrics() -> None:
    rng = random.Random(3)
    first = [[rng.randrange(10, 250) for _ in range(96)] for _ in range(4)]
    other = [[rng.randrange(10, 250) for _ in range(96)] for _ in range(4)]
    engine = {"num_blocks": 32, "kv_offloading_size": tier_gib(128, 16)}
    with serve(tiny_settings(engine)) as server:
        client = server.client()

        def complete(prompt: list[int]) -> int:
            out = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=2, temperature=0
            )
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            return out.usage.prompt_tokens_details.cached_tokens or 0

        for prompt in first + other:  # one at a time: the others evict the first from the pool
            assert complete(prompt) == 0
        assert [complete(prompt) for prompt in first] == [80] * 4  # 5 of 6 blocks
        m = server.wait_until_idle()
    capacity = m[("quire_kv_offload_blocks_capacity", ())]
    assert capacity == 128
    assert m[("quire_kv_offload_capacity_bytes", ())] == 128 * 16 * 4096
    assert 0 < m[("quire_kv_offload_blocks_used", ())] <= capacity
    assert m[("quire_kv_offload_usage_ratio", ())] == m[("quire_kv_offload_blocks_used", ())] / 128
    hits = m[("quire_prefix_cache_host_hits_total", ())]
    assert hits == 4 * 80 == m[("vllm:external_prefix_cache_hits_total", (("engine", "0"),))]
    assert m[("quire_prefix_cache_host_queries_total", ())] >= 8 * 96
    assert m[("quire_prefix_cache_hits_total", ())] >= hits
    for kind in TransferType:
        label = (("transfer_type", kind.value),)
        blocks = m[("quire_kv_offload_blocks_total", label)]
        assert blocks > 0
        assert m[("quire_kv_offload_bytes_total", label)] == blocks * 16 * 4096
        vllm = (("engine", "0"), ("transfer_type", kind.value))
        assert m[("vllm:kv_offload_total_bytes_total", vllm)] == blocks * 16 * 4096
    assert m[("quire_kv_offload_blocks_total", (("transfer_type", "CPU_to_GPU"),))] >= 4 * 5
    # The router's per-replica prefix index is sized from this label: device plus host blocks.
    (info,) = [dict(labels) for name, labels in m if name == "vllm:cache_config_info"]
    assert (info["num_gpu_blocks"], info["num_prefix_blocks"]) == ("32", str(32 + 128))
