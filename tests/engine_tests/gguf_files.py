"""Tiny GGUF files written from a transformers model, for the GGUF loader's family tests.

Writes what llama.cpp's ``convert_hf_to_gguf.py`` would for the simple dense families (the
tensor names of ``gguf``'s own name map, the architecture's metadata keys, float32 tensors),
including llama.cpp's row permutation of a Llama's q/k projections (its RoPE layout), which
transformers undoes on load. No tokenizer is stored: the tests pass ``tokenizer_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# transformers model_type -> the GGUF architecture.
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write(model: Any, path: Path) -> Path:
    """``model`` (a float32 Llama, Qwen2 or Qwen3 causal LM) as the GGUF file ``path``."""
    config = model.config
    arch = ARCHS[config.model_type]
    name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)  # transformers: a Llama's head_dim
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert target is not None, key
        if config.model_type == "llama" and key.endswith("q_proj.weight"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif config.model_type == "llama" and key.endswith("k_proj.weight"):
            tensor = _permute(tensor, config.num_key_value_heads)
        writer.add_tensor(target, tensor.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
