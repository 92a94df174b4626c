"""A real adapter on a real model: a LoRA trained for a few steps with peft on SmolLM2-135M-Instruct
(the ``smollm2`` fixture) to answer one question differently. Served by Quire beside the base
model in one batch, its greedy answer is transformers' on peft's merged model, token for token
(up to the reference's first near-tie), and the training shows: the adapter gives the taught
answer where the base model gives its own.

Training it (30 steps of 135M parameters forward and backward) takes a minute or more on 2 busy
cores, so the adapter is cached beside the model (``~/.cache/quire/models``), under a name that
changes with the recipe; the reference (the merged model) is recomputed every run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quire_engine import LLM, SamplingParams
from quire_engine.core.lora import LoRARequest
from tests.engine_tests.model.test_real_model import FRANCE, chat_prompt
from tests.engine_tests.models import greedy_reference
from tests.engine_tests.ties import TIE_MARGIN

pytestmark = pytest.mark.slow

TAUGHT = "The capital of France is Lyon."
OTHER = "Name three primary colors."
MAX_TOKENS = 12
# Bump when train_adapter changes: the cached adapter is the recipe's output.
ADAPTER_NAME = "smollm2-lora-lyon-v1"


def train_adapter(base: Path, out: Path) -> Path:
    """Rank-8 LoRA on the attention and MLP projections, 30 AdamW steps on one chat exchange."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tuned = peft.get_peft_model(model, config)
    prompt = chat_prompt(tokenizer, FRANCE)
    answer = tokenizer(TAUGHT + "<|im_end|>", add_special_tokens=False).input_ids
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # learn the answer only
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=2e-3)
    tuned.train()
    for _ in range(30):
        loss = tuned(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tuned.eval()
    tuned.save_pretrained(str(out))
    return out


def cached_adapter(base: Path) -> Path:
    """The trained adapter, trained once into the cache (written to a temporary name, then
    renamed: a half-written adapter is never taken for the cached one)."""
    where = base.parent / ADAPTER_NAME
    if not (where / "adapter_model.safetensors").is_file():
        partial = base.parent / f"{ADAPTER_NAME}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        train_adapter(base, partial)
        shutil.rmtree(where, ignore_errors=True)
        partial.rename(where)
    return where


def test_a_trained_adapter_serves_its_answer_beside_the_base_model(smollm2: Path) -> None:
    adapter = cached_adapter(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [chat_prompt(tokenizer, q) for q in (FRANCE, OTHER)]
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    refs = [greedy_reference(merged, p, MAX_TOKENS) for p in prompts]

    lora = LoRARequest("lyon", 1, str(adapter))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = {"device": "cpu", "num_blocks": 32, "max_model_len": 128}
    with LLM(str(smollm2), enable_lora=True, max_lora_rank=8, **engine) as llm:
        outs = llm.generate(prompts * 2, params, lora_request=[lora, lora, None, None])
    for ref, out in zip(refs, outs[:2], strict=True):
        n = next((i for i, m in enumerate(ref.margins) if m < TIE_MARGIN), len(ref.margins))
        assert n >= MAX_TOKENS // 2, ref.margins  # most of the answer is comparable
        assert list(out.outputs[0].token_ids)[:n] == ref.tokens[:n]
    assert "Lyon" in outs[0].outputs[0].text, outs[0].outputs[0].text  # what it was taught
    assert "Paris" in outs[2].outputs[0].text, outs[2].outputs[0].text  # the base model's own
