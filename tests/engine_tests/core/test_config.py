"""Bad sizes and modes fail at construction with a ValueError naming the field and the limit."""

from __future__ import annotations

import pytest

from quire_engine.core.config import CacheConfig, PreemptionMode, SchedulerConfig
from quire_engine.core.sequence import Sequence


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block_size must be a power of two in 1..256; got 12"),
        ({"block_size": 512}, "block_size must be a power of two in 1..256; got 512"),
        ({"block_size": 0}, "block_size must be a power of two"),
        ({"block_size": True}, "block_size must be an integer"),
        ({"num_blocks": 0}, "num_blocks must be >= 1; got 0"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks must be >= 0; got -1"),
    ],
)
def test_cache_config_rejects(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"num_blocks": 8}
    with pytest.raises(ValueError, match=message):
        CacheConfig(**(base | kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 128, 256])
def test_cache_config_accepts_powers_of_two(block_size: int) -> None:
    assert CacheConfig(num_blocks=1, block_size=block_size).block_size == block_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_batched_tokens": -5}, "max_num_batched_tokens must be >= 1; got -5"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1; got 0"),
        ({"max_model_len": 0}, "max_model_len must be >= 1; got 0"),
        ({"preemption_mode": "evict"}, "preemption_mode must be one of recompute, swap"),
    ],
)
def test_scheduler_config_rejects(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_scheduler_config_parses_mode_and_is_frozen() -> None:
    cfg = SchedulerConfig(preemption_mode="swap")  # type: ignore[arg-type]
    assert cfg.preemption_mode is PreemptionMode.SWAP
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 3  # type: ignore[misc]


def test_sequence_rejects_empty_prompt_and_bad_max_tokens() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Sequence("a", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1; got 0"):
        Sequence("a", [1], max_tokens=0)
