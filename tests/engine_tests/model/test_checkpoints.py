"""Checkpoints as the hub ships them: sharded safetensors with an index, generation_config.json
(its EOS list stops generation; its sampling values become the offline defaults), the
tokenizer's own chat template or ``--chat-template`` (no fallback: a model without one answers
chat with a 400), half-precision weights on CPU, and the load-time refusals of what Quire cannot
serve exactly (an architecture outside the tested list, an attention call it cannot honour, a
RoPE that rescales with the batch)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from quire_engine import LLM, SamplingParams
from quire_engine.model import loader as model_loader
from quire_engine.model.attention import inspect_layers
from quire_engine.model.tiny_model import build_tokenizer
from tests.engine_tests.live_server import serve, tiny_settings
from tests.engine_tests.model.test_llm_equivalence import MAX_TOKENS, hf_reference, prompts
from tests.engine_tests.models import COMMON, build

SMALL = {"num_blocks": 64, "max_model_len": 128, "device": "cpu"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index_is_token_exact(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="150KB")
    build_tokenizer().save_pretrained(tmp_path)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 1
    reference = hf_reference(str(model_dirs["llama"]))  # tie-free (checked there)
    llm = LLM(str(tmp_path), **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = llm.generate(prompts()[:4], params)
    assert [r.outputs[0].token_ids for r in results] == [ref.tokens for ref in reference[:4]]
    shards[-1].unlink()
    with pytest.raises(ValueError, match=f"missing.*{shards[-1].name}"):
        LLM(str(tmp_path), **SMALL)


def test_generation_config_eos_list_and_sampling_defaults(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    ref = hf_reference(str(model_dirs["llama"]))[0]
    # A token the greedy path first emits at step k becomes a second EOS: generation stops there.
    k = next(i for i in range(3, len(ref.tokens)) if ref.tokens[i] not in ref.tokens[:i])
    stop = ref.tokens[k]
    path = _copy(model_dirs["llama"], tmp_path / "ckpt")
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [257, stop], "temperature": 0.6, "top_p": 0.9, "top_k": 0})
    )
    llm = LLM(str(path), **SMALL)
    assert llm.engine.eos_token_ids == {257, stop}
    assert llm.engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
    out = llm.generate([prompts()[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert out[0].outputs[0].token_ids == ref.tokens[: k + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    # ignore_eos still runs to max_tokens.
    out = llm.generate(
        [prompts()[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == ref.tokens
    # Bad sampling values in the file are named at load time.
    (path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config\.json.*temperature"):
        LLM(str(path), **SMALL)


def test_chat_template_flag_or_400_and_server_sampling_defaults(tmp_path: Path) -> None:
    """A tokenizer without a chat template: chat is a 400 (no foreign template), completions
    work, ``chat_template`` supplies one. The server fills unset sampling fields from
    generation_config.json: here temperature 0, so a request without one decodes greedily."""
    path = build("llama", tmp_path / "ckpt")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    llm = LLM(str(path), chat_template=str(template), **SMALL)
    assert llm.tokenizer.chat_template == template.read_text()
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(path), chat_template=str(tmp_path / "missing.jinja"), **SMALL)

    engine = {"model": str(path), "num_blocks": 32, "max_model_len": 128}
    with serve(tiny_settings(engine, served_model_names=("ckpt",))) as server:
        client = server.client()
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(
                model="ckpt", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        # Completions need no template; no temperature in the request: the checkpoint's 0.
        out = client.completions.create(model="ckpt", prompt="Hello", max_tokens=12)
        assert out.choices[0].text == greedy.outputs[0].text


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_weights_on_cpu(dtype: str, model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), dtype=dtype, **SMALL)
    assert next(llm.engine.runner.model.parameters()).dtype == getattr(torch, dtype)
    ref = hf_reference(str(model_dirs["llama"]))[0]
    out = llm.generate(
        [prompts()[0]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    )[0].outputs[0]
    # One step from the same prompt: half-precision log-probabilities near fp32's.
    assert out.logprobs is not None
    for token, logprob in out.logprobs[0].items():
        assert abs(logprob - float(ref.logprobs[0, token])) < 0.1


def _save(model: tf.PreTrainedModel, path: Path) -> Path:
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    config = tf.GPT2Config(vocab_size=320, n_embd=32, n_layer=1, n_head=2)
    path = _save(tf.GPT2LMHeadModel(config), tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(path), **SMALL)


def test_attention_quire_cannot_honour_is_refused() -> None:
    """Attention sinks (gpt-oss passes ``s_aux``) and bidirectional layers are refused by the
    load-time audit, never silently dropped."""
    sinks = tf.GptOssForCausalLM(
        tf.GptOssConfig(
            **COMMON | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["full_attention"] * 2,
        )
    ).eval()
    with pytest.raises(ValueError, match="s_aux"):
        inspect_layers(sinks, 2, 16)
    bidirectional = tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(
            **COMMON | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
            use_bidirectional_attention=True,
        )
    ).eval()
    with pytest.raises(ValueError, match="non-causal"):
        inspect_layers(bidirectional, 2, 16)


def test_inspect_layers_reports_windows_and_softcap(model_dirs: dict[str, Path]) -> None:
    net = AutoModelForCausalLM.from_pretrained(model_dirs["gemma2"], dtype=torch.float32)
    layers = inspect_layers(net.eval(), 2, 16)
    assert [(x.sliding_window, x.softcap, x.scaling) for x in layers] == [
        (20, 2.0, 8**-0.5),
        (None, 2.0, 8**-0.5),
    ]
    with pytest.raises(ValueError, match="cache is 4 x 16"):
        inspect_layers(net, 4, 16)


def test_rope_that_rescales_with_the_batch(tmp_path: Path) -> None:
    dynamic = COMMON | {
        "num_attention_heads": 4,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    path = _save(tf.LlamaForCausalLM(tf.LlamaConfig(**dynamic)), tmp_path / "dynamic")
    with pytest.raises(ValueError, match="'dynamic' rescales RoPE"):
        LLM(str(path), **SMALL)
    # longrope is static below original_max_position_embeddings: served up to there.
    longrope = COMMON | {
        "num_attention_heads": 4,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                         "long_factor": [2.0] * 8, "original_max_position_embeddings": 64},
    }  # fmt: skip
    path = _save(tf.Phi3ForCausalLM(tf.Phi3Config(**longrope)), tmp_path / "longrope")
    loaded = model_loader.load(str(path), torch.device("cpu"), torch.float32)
    assert loaded.max_position_embeddings == 64
    with pytest.raises(ValueError, match="original_max_position_embeddings=64"):
        LLM(str(path), **SMALL)
    assert LLM(str(path), num_blocks=16, max_model_len=64, device="cpu").engine.max_model_len == 64


@pytest.mark.parametrize("arch", ["gemma2", "mixtral", "phi3"])
def test_profiling_attention_runs_every_architecture(
    arch: str, model_dirs: dict[str, Path]
) -> None:
    """The pool sizing forward (``profile_peak_memory`` on CUDA) swaps attention for one that
    outputs zeros: it must run where transformers refuses SDPA (Gemma 2) and leave the model's
    own implementation in place afterwards."""
    from quire_engine.model.attention import register_profiling

    net = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    impl = net.config._attn_implementation
    net.set_attn_implementation(register_profiling())
    with torch.inference_mode():
        out = net(input_ids=torch.zeros((1, 40), dtype=torch.long), use_cache=False)
    assert out.logits.shape == (1, 40, 320)
    net.set_attn_implementation(impl)
    assert net.config._attn_implementation == impl
