"""Tie-proof test data: token-exact comparisons are only well defined away from near-ties.

Two runs of the same weights differ in the last bits of their logits whenever anything about the
arithmetic differs: another CPU's instruction set or BLAS path, a thread count, or (between two
engine runs) the batch a sequence was computed in. Where the top-2 logits are closer than that
noise, greedy decoding may legitimately take either token. A test that compares greedy tokens
across such runs first proves its data has no such step: every step's top-1 minus top-2
log-probability (equal to the logit gap) is at least ``TIE_MARGIN``, else it fails loudly and
names the place, so the data can be changed instead of the test going flaky on some machine.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from quire_engine.core.outputs import RequestOutput

# Logit noise between CPUs, thread counts and batch shapes is ~1e-6 in float32; engine and
# reference log-probabilities are held to 1e-4. A 1e-3 gap leaves the argmax no room to flip.
TIE_MARGIN = 1e-3


def assert_tie_free(results: Sequence[RequestOutput]) -> None:
    """Every greedy step of every output (generated with ``logprobs >= 2``) has a top-2 gap of at
    least ``TIE_MARGIN``."""
    for i, result in enumerate(results):
        for out in result.outputs:
            assert out.logprobs, "generate the baseline with SamplingParams(logprobs=2)"
            for step, top in enumerate(out.logprobs):
                best, second = sorted(top.values(), reverse=True)[:2]
                assert best - second >= TIE_MARGIN, (
                    f"prompt {i} ({result.prompt!r}) has a near-tie at step {step} (top-2 gap "
                    f"{best - second:.1e} < {TIE_MARGIN}): greedy identity across runs is not "
                    "well defined there; change the test's prompts"
                )


def assert_ranking_tie_free(scores: Sequence[float], keep: int, margin: float, what: str) -> None:
    """The best ``keep`` of ``scores`` are ordered, and told apart from the rest, by gaps of at
    least ``margin``: a search that must reproduce that ranking cannot flip it on noise."""
    ranked = sorted(scores, reverse=True)[: keep + 1]
    gaps = [a - b for a, b in itertools.pairwise(ranked)]
    if gaps:
        rank = min(range(len(gaps)), key=gaps.__getitem__)
        assert gaps[rank] >= margin, (
            f"{what}: ranks {rank} and {rank + 1} are {gaps[rank]:.1e} apart (< {margin}); "
            "change the test's model or prompt"
        )
