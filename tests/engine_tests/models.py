"""Tiny random-weight checkpoints of every supported architecture, built from transformers configs
(nothing downloaded). Small enough for CPU tests, wide init so greedy outputs are diverse.

Each architecture has a pinned weight seed whose greedy path over the equivalence prompts has no
near-tie: at every step the reference's top-2 logit margin is at least ``TIE_MARGIN`` (see
``ties``), so the argmax cannot flip between CPUs, BLAS paths or thread counts.
``test_llm_equivalence`` checks the margin and fails loudly if a new transformers version or a new
architecture breaks it; ``python -m tests.engine_tests.models`` prints the margin of candidate seeds
to pick a new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel

from quire_engine.model.tiny_model import TINY_VOCAB_SIZE, build_tokenizer
from tests.engine_tests.ties import TIE_MARGIN

# Keyword arguments of a transformers config class: values of many types (sizes, ids, the
# rope_scaling dict, layer type lists) that transformers checks when it builds the config.
ConfigKwargs = dict[str, Any]

COMMON: ConfigKwargs = {
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
# Windows are shorter than most test contexts (prompts of 1..64 tokens plus 24 generated), and
# deliberately not multiples of the block sizes tested (8, 16, 32).
WINDOW = 20
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]

Arch = tuple[type[PretrainedConfig], type[PreTrainedModel], ConfigKwargs]
ARCHITECTURES: dict[str, Arch] = {
    # GQA 8:2 (ratio 4)
    "llama": (
        tf.LlamaConfig,
        tf.LlamaForCausalLM,
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16},
    ),
    # Llama 3.1's rope_scaling: frequencies rescaled by wavelength against an original context
    # of 32 positions, so the test contexts (up to 88) span both regimes.
    "llama3-rope": (
        tf.LlamaConfig,
        tf.LlamaForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # Sliding window on every layer: blocks wholly outside it are released while running.
    "mistral": (
        tf.MistralConfig,
        tf.MistralForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": WINDOW,
        },
    ),
    # Qwen2: q/k/v projections with bias, MHA (ratio 1)
    "qwen2": (
        tf.Qwen2Config,
        tf.Qwen2ForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 4},
    ),
    # Qwen3: per-head RMSNorm on q and k, GQA ratio 2, head_dim != hidden/heads
    "qwen3": (
        tf.Qwen3Config,
        tf.Qwen3ForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    ),
    # Gemma: multi-query (one KV head), embeddings scaled by sqrt(hidden), (1 + w) RMSNorm
    "gemma": (
        tf.GemmaConfig,
        tf.GemmaForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16},
    ),
    # Gemma 2: alternating local/global layers, attention logit soft-cap (small enough to bite),
    # query_pre_attn_scalar scaling, final logit soft-cap
    "gemma2": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": LOCAL_GLOBAL,
            "query_pre_attn_scalar": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Gemma 3 (text): local/global layers with their own RoPE bases, q/k norms
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": LOCAL_GLOBAL,
            "query_pre_attn_scalar": 16,
        },
    ),
    # Phi-3: fused qkv and gate/up projections, a sliding window on every layer
    "phi3": (
        tf.Phi3Config,
        tf.Phi3ForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": WINDOW + 7},
    ),
    # Mixtral: top-2 of 4 experts
    "mixtral": (
        tf.MixtralConfig,
        tf.MixtralForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # Qwen3-MoE: top-2 of 4 experts with normalised routing weights, q/k norms
    "qwen3-moe": (
        tf.Qwen3MoeConfig,
        tf.Qwen3MoeForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    ),
    # OLMo 2: RMSNorm over the whole q/k projections, norms after attention and MLP
    "olmo2": (
        tf.Olmo2Config,
        tf.Olmo2ForCausalLM,
        {"num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    # Granite: embedding, attention, residual and logit multipliers (attention scale != 1/sqrt(d))
    "granite": (
        tf.GraniteConfig,
        tf.GraniteForCausalLM,
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "embedding_multiplier": 2.0,
            "attention_multiplier": 0.1,
            "residual_multiplier": 0.5,
            "logits_scaling": 2.0,
        },
    ),
}


def tiny_llama_config(**overrides: Any) -> tf.LlamaConfig:
    """The small Llama that unit tests build by hand (no pinned seed, not saved): two layers,
    hidden 32, four query heads of 8 over two KV heads; ``overrides`` (the vocabulary, the MLP
    width, the init) on top."""
    shape: ConfigKwargs = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    return tf.LlamaConfig(**(shape | overrides))


# Weight seed per architecture, chosen with `python -m tests.engine_tests.models`: the first
# seed (from 1) whose greedy paths over the equivalence prompts keep every top-2 margin >= 3e-3.
# Min margins measured (transformers 5.24, CPU fp32): llama 1.7e-2, llama3-rope 3.7e-3,
# mistral 4.2e-3, qwen2 4.0e-3, qwen3 1.3e-2, gemma 1.1e-2, gemma2 5.9e-3, gemma3 4.1e-3,
# phi3 1.3e-2, mixtral 3.5e-3, qwen3-moe 5.8e-3, olmo2 3.5e-3, granite 7.3e-3.
SEEDS: dict[str, int] = {
    "llama": 5, "llama3-rope": 1, "mistral": 3, "qwen2": 5, "qwen3": 6, "gemma": 1, "gemma2": 1,
    "gemma3": 2, "phi3": 4, "mixtral": 2, "qwen3-moe": 1, "olmo2": 2, "granite": 1,
}  # fmt: skip


def build(arch: str, path: Path, seed: int | None = None, **overrides: Any) -> Path:
    """Save a tiny checkpoint of ``arch`` (weights from ``seed``, default its pinned tie-free one)
    with the embedded byte tokenizer into ``path``."""
    seed = SEEDS[arch] if seed is None else seed
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


@dataclass(frozen=True)
class GreedyPath:
    """transformers' own greedy decode of one prompt (EOS does not stop it)."""

    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab] float32 log-softmax of the logits at each step
    margins: list[float]  # top-1 minus top-2 logit at each step


def greedy_reference(model: PreTrainedModel, prompt: list[int], max_tokens: int) -> GreedyPath:
    assert isinstance(model, GenerationMixin), f"{type(model).__name__} does not generate"
    # ignore_eos means "EOS does not stop", not "EOS is forbidden" (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device=model.device)
    gen = model.generate(
        ids,
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=258,
    )
    logits = torch.stack([lg[0].float().cpu() for lg in gen.logits])  # [steps, vocab]
    top2 = torch.topk(logits, 2, dim=-1).values  # [steps, 2]
    return GreedyPath(
        tokens=gen.sequences[0, ids.shape[1] :].tolist(),
        logprobs=torch.log_softmax(logits, dim=-1),
        margins=(top2[:, 0] - top2[:, 1]).tolist(),
    )


def _print_seed_margins(archs: list[str], seeds: range) -> None:
    """For each architecture and candidate seed, the smallest greedy margin over the equivalence
    prompts; pick a seed whose margin is comfortably above TIE_MARGIN."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from tests.engine_tests.model.test_llm_equivalence import MAX_TOKENS, prompts

    with tempfile.TemporaryDirectory() as root:
        for arch in archs:
            for seed in seeds:
                path = build(arch, Path(root) / f"{arch}-{seed}", seed=seed)
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                low = min(min(greedy_reference(model, p, MAX_TOKENS).margins) for p in prompts())
                flag = "ok" if low >= TIE_MARGIN else "near-tie"
                print(f"{arch:12} seed {seed:3}  min margin {low:.2e}  {flag}", flush=True)


if __name__ == "__main__":
    import sys

    # python -m tests.engine_tests.models [ARCH ...]: every architecture by default.
    _print_seed_margins(sys.argv[1:] or list(ARCHITECTURES), range(1, 9))
