"""The embedded default model: a small Llama with deterministic random weights and a byte-level
tokenizer, both built in code, so ``quire-engine serve`` and the tests run with no download.

The weights are random, so its text is noise; what matters is that it is a real Llama-architecture
checkpoint (GQA, RoPE, RMSNorm) exercising every code path of the engine. ``initializer_range`` is
widened from Llama's 0.02 so that greedy decoding is diverse: a wrong attention kernel cannot pass a
token-exact test by emitting the same token forever.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# The tokenizer's "vocabulary" is the 256 byte symbols plus three specials; the model's embedding
# is padded to a multiple of 64 as real checkpoints do.
NUM_BYTES = 256
TINY_VOCAB_SIZE = 320

# A role-tagged template in the Hermes style (Qwen's): the tiny model has no chat training, this
# only fixes the format. It renders ``tools`` (their names), an assistant's ``tool_calls`` as
# ``<tool_call>{...}</tool_call>`` (what ``--tool-call-parser hermes`` reads) and a tool's answer,
# so every ``tool_choice`` works on the default model.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools:{% for tool in tools %} {{ tool.function.name }}"
    "{% endfor %}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|assistant|>\n"
    "{% for call in message.tool_calls %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}\n"
    "{% elif message.role == 'tool' %}<|tool|>\n{{ message.tool_call_id }}: "
    "{{ message.content }}\n"
    "{% else %}<|{{ message.role }}|>\n{{ message.content }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_order() -> dict[str, int]:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_ORDER = _byte_order()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: every UTF-8 byte is one token (ids 0..255), BOS 256,
    EOS 257, PAD 258. Any text round-trips exactly."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: _BYTE_ORDER[symbol] for symbol in alphabet}
    for i, special in enumerate((BOS, EOS, PAD)):
        vocab[special] = NUM_BYTES + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, NUM_BYTES)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(**overrides: Any) -> LlamaConfig:
    params: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "initializer_range": 0.1,
        "bos_token_id": NUM_BYTES,
        "eos_token_id": NUM_BYTES + 1,
        "pad_token_id": NUM_BYTES + 2,
        "tie_word_embeddings": False,
    }
    params.update(overrides)
    return LlamaConfig(**params)


def build_tiny_model(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """Deterministic random weights: the same seed gives the same model on every machine."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(**overrides))
    return model.eval()


def save_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """Write the embedded model as an ordinary HF checkpoint directory (safetensors + tokenizer)."""
    path = Path(path)
    build_tiny_model(seed).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
