"""Tiny random-weight checkpoints of every supported architecture, built from transformers configs
(nothing downloaded). Small enough for CPU tests, wide init so greedy outputs are diverse."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from quire_engine.tiny_model import TINY_VOCAB_SIZE, build_tokenizer

COMMON: dict[str, object] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.3,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "tie_word_embeddings": False,
}

ARCHITECTURES: dict[
    str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]
] = {
    # GQA 8:2 (ratio 4)
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16},
    ),
    # Mistral's sliding window is wider than any test context, so full attention is exact.
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 512},
    ),
    # Qwen2: q/k/v projections with bias, MHA (ratio 1)
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"num_attention_heads": 4, "num_key_value_heads": 4}),
    # Qwen3: per-head RMSNorm on q and k, GQA ratio 2, head_dim != hidden/heads
    "qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    ),
}


def build(arch: str, path: Path, seed: int = 1, **overrides: object) -> Path:
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = config_cls(**(COMMON | extra | overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    if arch == "qwen2":
        # transformers initialises biases to zero; make them matter.
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
