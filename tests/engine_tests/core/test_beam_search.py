"""Beam search against brute force on a tiny vocabulary: exhaustive when the beam is wide enough
to keep every prefix, and a recompute-everything reference beam search otherwise."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from quire_engine import LLM
from quire_engine.core.outputs import CompletionOutput
from quire_engine.model.tiny_model import build_tokenizer
from tests.engine_tests.models import tiny_llama_config
from tests.engine_tests.ties import assert_ranking_tie_free

PROMPT = [1, 4, 2, 5, 3, 0, 1, 2, 3, 4, 5, 0, 2, 2]  # 14 tokens: fits and crosses blocks of 8
# Scores are compared within 1e-4; rankings are only compared where neighbouring reference scores
# are further apart than two tolerances (engine-vs-reference noise is ~1e-6).
SCORE_TOLERANCE = 1e-4
RANK_MARGIN = 2 * SCORE_TOLERANCE


def tiny_vocab_model(path: Path, vocab: int) -> Path:
    config = tiny_llama_config(
        vocab_size=vocab,
        intermediate_size=64,
        max_position_embeddings=64,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        LlamaForCausalLM(config).eval().save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _cumulative(out: CompletionOutput) -> float:
    assert out.cumulative_logprob is not None, "a beam reports its cumulative log-probability"
    return out.cumulative_logprob


def sequence_logprobs(model: LlamaForCausalLM, continuations: list[list[int]]) -> list[float]:
    """Sum of log p(token) over each continuation, from full recomputation (no cache)."""
    ids = torch.tensor([PROMPT + c for c in continuations])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    n = len(PROMPT)
    out = []
    for row, cont in enumerate(continuations):
        out.append(sum(float(logp[row, n - 1 + i, t]) for i, t in enumerate(cont)))
    return out


def test_wide_beam_equals_exhaustive_search(tmp_path: Path) -> None:
    vocab, length = 6, 3
    path = tiny_vocab_model(tmp_path / "m", vocab)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    everything = [list(c) for c in itertools.product(range(vocab), repeat=length)]
    scores = sequence_logprobs(model, everything)
    best = sorted(zip(scores, everything, strict=True), key=lambda x: -x[0])[: vocab**2]
    assert_ranking_tie_free(scores, vocab**2, RANK_MARGIN, "exhaustive scores")

    llm = LLM(str(path), device="cpu", block_size=8, num_blocks=256, max_model_len=64)
    beams = llm.beam_search([PROMPT], beam_width=vocab**2, max_tokens=length, ignore_eos=True)
    outs = beams[0].outputs
    assert len(outs) == vocab**2
    got = [_cumulative(o) for o in outs]
    assert got == sorted(got, reverse=True)
    assert [o.token_ids for o in outs] == [c for _, c in best]
    for out, (score, _) in zip(outs, best, strict=True):
        assert out.cumulative_logprob == pytest.approx(score, abs=SCORE_TOLERANCE)
    assert llm.kv_cache_stats().used == 0


def reference_beam_search(
    model: LlamaForCausalLM, width: int, length: int
) -> list[tuple[list[int], float]]:
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(length):
        ids = torch.tensor([PROMPT + b for b, _ in beams])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[:, -1].float(), dim=-1)
        cands = [
            (cum + float(logp[i, t]), i, t)
            for i, (_, cum) in enumerate(beams)
            for t in range(logp.shape[1])
        ]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        assert_ranking_tie_free([c[0] for c in cands], width, RANK_MARGIN, "reference beam step")
        beams = [(beams[i][0] + [t], s) for s, i, t in cands[:width]]
    return beams


# TP=2: the ranks share one plan, so beams fork and share blocks on every rank alike.
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_narrow_beam_matches_reference_and_shares_blocks(
    tmp_path: Path, tensor_parallel_size: int
) -> None:
    path = tiny_vocab_model(tmp_path / "m", 10)
    model = LlamaForCausalLM.from_pretrained(path).eval()
    expected = reference_beam_search(model, width=3, length=7)

    llm = LLM(
        str(path),
        device="cpu",
        block_size=8,
        num_blocks=64,
        max_model_len=64,
        enable_prefix_caching=False,
        tensor_parallel_size=tensor_parallel_size,
    )
    engine = llm.engine
    from quire_engine.core.sampling_params import SamplingParams

    engine.add_request(
        "beam", PROMPT, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), beam_width=3
    )
    shared_seen = 0
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
        pool = engine.scheduler.kv.pool
        shared_seen = max(shared_seen, sum(1 for b in pool.blocks if b.ref_count > 1))
    assert final is not None
    assert [o.token_ids for o in final.outputs] == [b for b, _ in expected]
    for beam, (_, score) in zip(final.outputs, expected, strict=True):
        assert beam.cumulative_logprob == pytest.approx(score, abs=SCORE_TOLERANCE)
    assert shared_seen >= 1  # beams shared the prompt's full block through fork
    assert llm.kv_cache_stats().used == 0
    llm.close()


def test_beam_width_must_be_positive() -> None:
    llm = LLM("tiny", device="cpu", num_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match="beam_width must be >= 1; got 0"):
        llm.beam_search(["x"], beam_width=0, max_tokens=3)
