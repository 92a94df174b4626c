"""Synthetic ShareGPT-like request lengths (no dataset download).

ShareGPT conversations have heavy-tailed prompt and output lengths; a log-normal fitted to the
requested means reproduces that shape. ``sigma`` controls the tail; lengths are clipped so that
prompt + output never exceeds ``max_model_len``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload


@dataclass(frozen=True, slots=True)
class RequestLengths:
    prompt: int
    output: int


def sharegpt_like(
    num_requests: int,
    *,
    mean_prompt: float = 200.0,
    mean_output: float = 180.0,
    sigma: float = 0.9,
    max_model_len: int = 2048,
    seed: int = 0,
) -> list[RequestLengths]:
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1; got {num_requests}")
    rng = random.Random(seed)
    # For LogNormal(mu, sigma) the mean is exp(mu + sigma^2 / 2).
    mu_p = math.log(mean_prompt) - sigma * sigma / 2
    mu_o = math.log(mean_output) - sigma * sigma / 2
    out = []
    for _ in range(num_requests):
        prompt = max(4, min(int(rng.lognormvariate(mu_p, sigma)), max_model_len // 2))
        output = max(1, min(int(rng.lognormvariate(mu_o, sigma)), max_model_len - prompt))
        out.append(RequestLengths(prompt, output))
    return out


def random_tokens(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@overload
def warm_up_prompts(prompts: Sequence[list[int]], count: int) -> list[list[int]]: ...
@overload
def warm_up_prompts(prompts: Sequence[str], count: int) -> list[str]: ...
@overload
def warm_up_prompts(prompts: Sequence[list[int] | str], count: int) -> list[list[int] | str]: ...
def warm_up_prompts(prompts: Sequence[Any], count: int) -> list[Any]:
    """Prompts for a system's warm-up run before its timed one: the first ``count`` workload
    prompts with their first token (or character, for text) replaced by the smallest one >= 1
    (>= " ") that starts no workload prompt. Same lengths, so the same shapes warm up, and no
    block in common with any workload prompt: a prefix-cache block's hash chains over every token
    before it, and a warm-up on the workload's own prompts would let an engine with a prefix
    cache skip part of its timed prefill."""
    if not prompts or count < 1:
        raise ValueError("warm_up_prompts needs prompts and a count >= 1")
    chars = {q[:1] for q in prompts if isinstance(q, str)}
    ids = {q[0] for q in prompts if not isinstance(q, str) and q}
    lead = next(c for c in map(chr, range(32, 0x110000)) if c not in chars)
    first = next(t for t in range(1, len(ids) + 2) if t not in ids)
    return [lead + p[1:] if isinstance(p, str) else [first, *p[1:]] for p in prompts[:count]]
