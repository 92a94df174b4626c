"""What an 8-bit KV cache costs on a real trained model (SmolLM2-135M-Instruct, the ``smollm2``
fixture): random-weight models cannot show quality loss.

- Perplexity of a real English text (``data/english.txt``, 279 tokens) under each format, from
  one prefill's prompt logprobs (every position reads its context's K/V back from the pool, as
  a decode does), against the float32 pool's: within 1 % for int8 and fp8_e4m3. fp8_e5m2 keeps
  2 mantissa bits (a step of 25 % of a value at worst, against e4m3's 12.5 %) and measured
  +2.0 % here: its bound is 3 %, and docs/kv-cache.md says to prefer the other two.
- Greedy chat answers against the float32 pool's by vLLM's ``check_logprobs_close`` rule (where
  the tokens differ, each is in the other's top 5, and the comparison stops there).
- The KL divergence figures per format are ``bench kv_cache --parts accuracy`` 's
  (docs/kv-cache.md); this test checks they stay small (mean KL below 0.05 nats).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quire_engine import LLM, SamplingParams
from quire_engine.bench.kv_cache import accuracy
from quire_engine.core.config import KVCacheDtype
from tests.engine_tests.model.test_real_model import QUESTIONS, chat_prompt

pytestmark = pytest.mark.slow

TEXT = Path(__file__).parents[1] / "data" / "english.txt"
PPL_BOUND = {KVCacheDtype.INT8: 0.01, KVCacheDtype.FP8_E4M3: 0.01, KVCacheDtype.FP8_E5M2: 0.03}
FORMATS = (KVCacheDtype.AUTO, *PPL_BOUND)
MAX_TOKENS = 24
TOP_K = 5


def test_perplexity_and_kl_of_each_format_stay_close_to_float32(smollm2: Path) -> None:
    report = accuracy(str(smollm2), TEXT.read_text(), list(FORMATS))
    rows = report["by_format"]
    assert report["tokens"] > 250
    base = rows["auto"]["perplexity"]
    assert 5 < base < 100, base  # a trained model on English: not uniform over 49k tokens
    for kv, bound in PPL_BOUND.items():
        row = rows[kv.value]
        assert abs(row["perplexity"] / base - 1) <= bound, (kv, row, base)
        assert 0 < row["kl_mean"] < 0.05, (kv, row)  # not the same pool, not a broken one
        assert row["top1_agreement"] >= 0.9, (kv, row)


@pytest.mark.parametrize("kv_dtype", list(PPL_BOUND), ids=lambda kv: kv.value)
def test_greedy_chat_answers_are_logprob_close_to_float32(
    smollm2: Path, kv_dtype: KVCacheDtype
) -> None:
    answers = {}
    for kv in (KVCacheDtype.AUTO, kv_dtype):
        with LLM(
            str(smollm2), device="cpu", num_blocks=16, max_model_len=128, kv_cache_dtype=kv.value
        ) as llm:
            prompts = [chat_prompt(llm.engine.tokenizer, q) for q in QUESTIONS]
            params = SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K
            )
            answers[kv] = [r.outputs[0] for r in llm.generate(prompts, params)]
    agreed = 0
    for ref, got in zip(answers[KVCacheDtype.AUTO], answers[kv_dtype], strict=True):
        assert ref.logprobs is not None and got.logprobs is not None
        for step, (want, token) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
            if want != token:
                assert token in ref.logprobs[step] and want in got.logprobs[step], (step, kv_dtype)
                break
            agreed += 1
    assert agreed >= MAX_TOKENS // 2, agreed  # the answers start the same
