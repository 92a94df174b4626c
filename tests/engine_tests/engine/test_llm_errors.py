"""Bad input gets a ValueError naming the field and the limit; the engine keeps working and no
block leaks (the autouse fixture checks the pool after each test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import EngineConfig
from quire_engine.model.tiny_model import save_tiny_model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", num_blocks=64, max_model_len=64)


def test_unknown_architecture(tmp_path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).save_pretrained(
        tmp_path
    )
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*supported: LlamaForCausalLM"
    ):
        LLM(str(tmp_path), device="cpu")


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a local directory"):
        LLM(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="has no weights"):
        LLM(str(tmp_path), device="cpu")


def test_checkpoint_directory_of_the_embedded_model_loads(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "tiny")
    a = LLM(str(path), device="cpu", num_blocks=32, max_model_len=64)
    b = LLM("tiny", device="cpu", num_blocks=32, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert (
        a.generate("same", params)[0].outputs[0].token_ids
        == b.generate("same", params)[0].outputs[0].token_ids
    )


def test_pool_too_small_names_the_numbers() -> None:
    with pytest.raises(
        ValueError,
        match=r"num_blocks=2 gives 2 blocks of 16 tokens .* "
        r"max_model_len=64 tokens needs 4",
    ):
        LLM(device="cpu", num_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"kv_cache_memory=1000 bytes gives 0 blocks"):
        LLM(device="cpu", kv_cache_memory=1000, max_model_len=64)


def test_max_model_len_beyond_the_model() -> None:
    with pytest.raises(
        ValueError, match="max_model_len=4096 exceeds the model's max_position_embeddings=2048"
    ):
        LLM(device="cpu", max_model_len=4096, num_blocks=512)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"swap_space": -1.0}, "swap_space must be >= 0 GiB"),
        ({"num_blocks": 0}, "num_blocks must be >= 1; got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"preemption_mode": "drop"}, "preemption_mode must be one of recompute, swap"),
    ],
)
def test_bad_engine_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_flat(kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"device": "tpu"}, "device must be auto, cpu or cuda"), ({"dtype": "int8"}, "dtype must be")],
)
def test_bad_device_and_dtype(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(num_blocks=8, max_model_len=64, **kwargs)


def test_bad_prompts_and_engine_keeps_running(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate("", params)
    with pytest.raises(ValueError, match="prompt must contain at least one token"):
        llm.generate([[]], params)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 320\)"):
        llm.generate([[1, 2, 999]], params)
    with pytest.raises(ValueError, match="prompt has 71 tokens, more than max_model_len=64"):
        llm.generate("x" * 70, params)
    # A bad prompt in a batch rejects the whole call; nothing stays queued or held.
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        llm.generate(["fine", "y" * 100], params)
    assert not llm.engine.has_unfinished()
    assert llm.kv_cache_stats().used == 0
    out = llm.generate(["fine", "also fine"], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_reset_prefix_cache_makes_the_same_prompt_miss(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = [[(7 * i) % 300 + 1 for i in range(40)]]  # two full blocks of 16
    kv = llm.engine.scheduler.kv
    first = llm.generate(prompt, params)
    hits = kv.prefix_hits
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert kv.prefix_hits == hits + 32
    assert llm.reset_prefix_cache() is True
    assert llm.kv_cache_stats().cached_free == 0
    again = llm.generate(prompt, params)
    assert kv.prefix_hits == hits + 32  # recomputed, not revived
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_unknown_engine_argument() -> None:
    with pytest.raises(ValueError, match="unknown engine arguments: blocksize"):
        LLM(blocksize=16)


def test_params_list_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])


def test_request_that_can_never_fit_is_rejected() -> None:
    llm = LLM(device="cpu", num_blocks=4, max_model_len=64)  # 64 slots
    # 60 prompt tokens + 10 more would need 5 blocks, but max_model_len caps it at 64: it fits.
    out = llm.generate("a" * 59, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == 64
    assert torch.is_grad_enabled()  # inference_mode stayed inside the runner
