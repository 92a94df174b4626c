"""Synthetic ShareGPT-like request lengths (no dataset download).

ShareGPT conversations have heavy-tailed prompt and output lengths; a log-normal fitted to the
requested means reproduces that shape. ``sigma`` controls the tail; lengths are clipped so that
prompt + output never exceeds ``max_model_len``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


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
