"""How to pick each next token; validated at construction (``ValueError`` names field and limit)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling controls, with vLLM's names and defaults.

    ``temperature == 0`` is greedy. ``top_k`` None means all tokens; ``top_p`` 1 and ``min_p`` 0
    disable those filters. ``seed`` makes this request's samples reproducible regardless of what it
    is batched with. ``n`` parallel samples share the prompt's KV blocks (fork + copy-on-write).
    ``logprobs`` asks for the sampled token's log-probability plus that many top alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers and keep the frozen value hashable.
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if _not_int(self.n) or self.n < 1:
            raise ValueError(f"n must be >= 1; got {self.n}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k is not None and (_not_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be None or >= 1; got {self.top_k}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1]; got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2]; got {value}")
        if _not_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.logprobs is not None and (
            _not_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]; got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and _not_int(self.seed):
            raise ValueError(f"seed must be an integer; got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _not_int(value: object) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
