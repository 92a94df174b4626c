"""The host tier end to end through ``LLM``: greedy outputs with the tier are token-identical to
recomputing, whatever the paging (block sizes, chunked prefill, preemption by recompute and by
swap, sliding windows, which leave hits before the window unloaded) and the KV format, and a
prompt evicted from the device pool is found in the tier
(``num_cached_tokens``) instead of recomputed.

The issue's reproduction: ``LLM(num_blocks=64)``, six 160-token prompts, six others that evict
them, then the first six again: without a tier none of the rerun's prompt tokens is cached."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import PreemptionMode
from tests.engine_tests.models import build

GIB = 2**30


def tier_gib(blocks: int, block_size: int, bytes_per_token: int = 4096) -> float:
    """``--kv-offloading-size`` for ``blocks`` blocks of the embedded model (4096 bytes per
    float32 token: 2 layers' K and V of its KV heads)."""
    return blocks * block_size * bytes_per_token / GIB


def _issue_prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(40)
    first = [[rng.randrange(10, 250) for _ in range(160)] for _ in range(6)]
    other = [[rng.randrange(10, 250) for _ in range(160)] for _ in range(6)]
    return first, other


def three_waves(
    llm: LLM, first: list[list[int]], other: list[list[int]], max_tokens: int
) -> tuple[list[list[list[int]]], list[int]]:
    """Greedy tokens of ``first``, ``other``, then ``first`` again; the rerun's cached tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    waves = [llm.generate(prompts, params) for prompts in (first, other, first)]
    tokens = [[list(r.outputs[0].token_ids) for r in wave] for wave in waves]
    cached = [r.num_cached_tokens for r in waves[2]]
    return tokens, cached


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_issue_reproduction_finds_the_evicted_prompts_in_the_tier(kv_cache_dtype: str) -> None:
    first, other = _issue_prompts()
    engine: dict[str, Any] = {"num_blocks": 64, "max_model_len": 512}
    engine["kv_cache_dtype"] = kv_cache_dtype
    with LLM(**engine) as plain:
        want, cached_without = three_waves(plain, first, other, 8)
    with LLM(**engine, kv_offloading_size=tier_gib(256, 16)) as tiered:
        got, cached_with = three_waves(tiered, first, other, 8)
        stats = tiered.engine.scheduler.stats()
        runner = tiered.engine.runner
        assert runner.host_pool is not None
        # The tier holds the pool's own format: 8-bit blocks with their float32 scales.
        assert [t.dtype for t in runner.host_pool.tensors] == [t.dtype for t in runner.device_pools]
    assert cached_without == [0] * 6
    assert cached_with == [144] * 6  # 9 of 10 blocks: the last token is always recomputed
    assert got == want and got[2] == got[0]
    assert stats.host is not None and stats.host.hits == 6 * 144 and stats.host.loaded >= 54


CONFIGS: dict[str, dict[str, Any]] = {
    "bs16": {"block_size": 16, "num_blocks": 24},
    "bs8-chunked-prefill": {"block_size": 8, "num_blocks": 40, "max_num_batched_tokens": 24},
    "preempt-recompute": {"block_size": 8, "num_blocks": 16, "preemption_mode": "recompute"},
    "preempt-swap": {
        "block_size": 8,
        "num_blocks": 16,
        "preemption_mode": "swap",
        "swap_space": 0.01,
    },
}


def paging_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Four prompts behind one 32-token system prompt, and four unrelated ones."""
    rng = random.Random(7)
    system = [rng.randrange(10, 250) for _ in range(32)]
    first = [system + [rng.randrange(10, 250) for _ in range(12 + 5 * i)] for i in range(4)]
    other = [[rng.randrange(10, 250) for _ in range(40 + 3 * i)] for i in range(4)]
    return first, other


@pytest.mark.parametrize(
    "device",
    # On CUDA (benchmarks/gpu.sh): the copy stream, pinned staging and deferred offloads, in
    # float32 so that the oracle's other batch shapes round alike.
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_outputs_with_the_tier_equal_recomputing(config: str, device: str) -> None:
    first, other = paging_prompts()
    engine: dict[str, Any] = {"max_model_len": 128, "max_num_seqs": 8, **CONFIGS[config]}
    engine |= {"device": device, "dtype": "float32"}
    oracle_engine = {**engine, "num_blocks": 256}
    oracle_engine.pop("preemption_mode", None)
    with LLM(**oracle_engine) as oracle:
        want, _ = three_waves(oracle, first, other, 16)
    block_size = engine["block_size"]
    assert isinstance(block_size, int)
    with LLM(**engine, kv_offloading_size=tier_gib(64, block_size)) as tiered:
        got, cached = three_waves(tiered, first, other, 16)
        scheduler = tiered.engine.scheduler
        stats = scheduler.stats()
    assert got == want
    assert stats.host is not None and stats.host.hits > 0 and stats.host.loaded > 0
    assert sum(cached) > 0
    mode = engine.get("preemption_mode")
    if mode is not None:
        assert scheduler.num_preemptions[PreemptionMode(mode)] > 0


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_sliding_window_models_load_only_what_the_window_sees(arch: str, tmp_path: Path) -> None:
    """Every layer has a sliding window: host hits wholly before the window of the first new
    token are taken as released entries, not loaded; the tokens stay those of recomputing."""
    path = str(build(arch, tmp_path / arch))
    first, other = paging_prompts()
    first, other = ([[t % 200 for t in p] for p in wave] for wave in (first, other))
    engine: dict[str, Any] = {"device": "cpu", "block_size": 8, "max_model_len": 128}
    engine["max_num_seqs"] = 8
    with LLM(path, num_blocks=256, **engine) as oracle:
        want, _ = three_waves(oracle, first, other, 16)
    with LLM(path, num_blocks=16, kv_offloading_size=tier_gib(64, 8, 512), **engine) as tiered:
        got, cached = three_waves(tiered, first, other, 16)
        stats = tiered.engine.scheduler.stats()
        assert tiered.engine.scheduler.kv.sliding_window is not None
    assert got == want and sum(cached) > 0
    assert stats.host is not None and 0 < stats.host.loaded < stats.host.hits // 8
