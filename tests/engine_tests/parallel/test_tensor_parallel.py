"""Tensor parallelism on CPU (gloo, one worker process per extra rank): token-exact against one
rank and against transformers, for every architecture that shards, with prefix caching on and off
and forced preemption by recompute and by swap; clear refusals for the others.

The equivalence checks are ``test_llm_equivalence.check_greedy`` with ``tensor_parallel_size`` on
top: the same tie-free models, prompts, logprob tolerance (1e-4 at every step against
transformers) and the same preemption / prefix-cache assertions. Llama at TP=2 runs by default
(prefix caching on and off, recompute and swap preemption); every other architecture and TP=4
(where the heads divide) are ``slow``: each engine starts its workers (a few seconds each).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import EngineConfig
from quire_engine.model.sharding import check
from tests.engine_tests.engine.test_host_tier_engine import paging_prompts, three_waves, tier_gib
from tests.engine_tests.model.test_llm_equivalence import CORE_VARIANTS, check_greedy
from tests.engine_tests.models import ARCHITECTURES, COMMON

MOE = {"mixtral", "qwen3-moe"}  # their matrix: test_tensor_parallel_moe.py
FAST = [("llama", v, 2) for v in (*CORE_VARIANTS, "noprefix-bs16", "preempt-recompute")]


def _heads(arch: str) -> tuple[int, int]:
    extra = ARCHITECTURES[arch][2]
    heads = int(extra["num_attention_heads"])
    return heads, int(extra.get("num_key_value_heads", heads))


def _shards(arch: str, world: int) -> bool:
    heads, kv = _heads(arch)
    return arch not in MOE and heads % world == 0 and (kv % world == 0 or world % kv == 0)


def _matrix() -> list[object]:
    cases: list[object] = list(FAST)
    for arch in ARCHITECTURES:
        if arch in MOE:
            continue
        for variant in CORE_VARIANTS:
            if arch != "llama":
                cases.append(pytest.param(arch, variant, 2, marks=pytest.mark.slow))
        if _shards(arch, 4) and not (arch == "olmo2" and _heads(arch)[1] < 4):
            cases.append(pytest.param(arch, "prefix-bs16", 4, marks=pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("arch", "variant", "tp"), _matrix())
def test_greedy_matches_transformers(
    arch: str, variant: str, tp: int, model_dirs: dict[str, Path]
) -> None:
    check_greedy(str(model_dirs[arch]), arch, variant, tensor_parallel_size=tp)


def test_tiny_model_matches_one_rank() -> None:
    """The embedded model (sharded from memory, not from files) at TP=2 gives TP=1's tokens."""
    prompts = ["Hello", "The quick brown fox", "a"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM("tiny", device="cpu", num_blocks=64, max_model_len=128) as one:
        expected = [r.outputs[0].token_ids for r in one.generate(prompts, params)]
    with LLM("tiny", device="cpu", num_blocks=64, max_model_len=128, tensor_parallel_size=2) as two:
        got = [r.outputs[0].token_ids for r in two.generate(prompts, params)]
        assert two.kv_cache_stats().used == 0
    assert got == expected


def _group_threads() -> list[str]:
    """This process's threads of c10d stores and gloo groups (their names, from /proc)."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir() if task.is_dir()]
    return sorted(name for name in names if name.startswith(("pt_tcpstore", "pt_gloo")))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names from Linux /proc")
def test_closing_the_engine_stops_its_store_and_group_threads() -> None:
    """Rank 0's store and gloo group live in the engine's process: closing the engine stops
    their threads at once (left to interpreter exit, they have hung pytest after its summary)."""
    before = _group_threads()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM("tiny", device="cpu", num_blocks=64, max_model_len=128, tensor_parallel_size=2) as llm:
        llm.generate(["Hello"], params)
        assert len(_group_threads()) > len(before)  # what this test watches exists
    deadline = time.monotonic() + 30
    while _group_threads() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_threads() == before


def test_heads_that_do_not_split_are_refused(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM .* 4 attention heads do not split"):
        LLM(str(model_dirs["qwen2"]), device="cpu", num_blocks=16, tensor_parallel_size=3)


def test_replicated_kv_heads_must_divide() -> None:
    config = ARCHITECTURES["llama"][0](
        **(COMMON | {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4})
    )
    with pytest.raises(ValueError, match="4 KV heads neither split over nor replicate"):
        check(config, 6)
    check(config, 2)  # 6 heads and 2 KV heads per rank


def test_tensor_parallel_size_is_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1; got 0"):
        EngineConfig.from_flat(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        EngineConfig.from_flat(tensor_parallel_size=1.5)


def test_host_tier_under_tensor_parallelism_matches_one_rank() -> None:
    """Every rank keeps its own heads' share of the host tier and performs the step plan's
    offloads and loads: TP=2 with a tier (prompts evicted and coming back, preemption by
    recompute) gives the tokens of one rank with a pool that never evicts."""
    first, other = paging_prompts()
    engine = {"device": "cpu", "block_size": 8, "max_model_len": 128, "max_num_seqs": 8}
    with LLM("tiny", num_blocks=256, **engine) as one:
        want, _ = three_waves(one, first, other, 16)
    # 64 blocks of every rank: kv_offloading_size counts the ranks together.
    tier = tier_gib(64, 8)
    with LLM(
        "tiny", num_blocks=16, tensor_parallel_size=2, kv_offloading_size=tier, **engine
    ) as two:
        got, cached = three_waves(two, first, other, 16)
        stats = two.engine.scheduler.stats()
    assert got == want
    assert stats.host is not None and stats.host.capacity == 64 and stats.host.hits > 0
    assert sum(cached) > 0
