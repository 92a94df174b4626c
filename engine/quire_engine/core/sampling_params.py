"""How to pick each next token; validated at construction (``ValueError`` names field and limit).

Every field is checked at its extremes (0, negative, tiny, huge, beyond int64, NaN/inf, a string
or a bool where a number belongs), because one request's parameters reach tensor code that would
otherwise raise in the middle of a batch. Limits follow vLLM where it has them: ``seed`` is an
int64, ``temperature`` is in [0, 2] and values below ``GREEDY_BELOW`` are greedy while values
below ``MIN_TEMPERATURE`` are raised to it (dividing logits by a tiny temperature overflows to
inf/NaN), ``top_k`` is capped at the vocabulary by the sampler. Limits that depend on the engine
(``n`` against ``max_num_seqs``, stop token ids against the vocabulary) are checked by
``LLMEngine.add_request``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from quire_engine.core.constraint import OutputConstraint

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 1024  # parallel samples per request (the engine also caps n at max_num_seqs)
MAX_STOPS = 32  # stop strings, and separately stop token ids, per request
MAX_STOP_CHARS = 256  # per stop string: each is searched in the tail of every new text
MAX_TEMPERATURE = 2.0
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # token ids per request (OpenAI's limit)


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
    # vLLM's further controls. ``repetition_penalty`` divides positive (multiplies negative)
    # logits of every token seen in the prompt or output; ``min_tokens`` bans the stop ids
    # (EOS, ``stop_token_ids``) until that many tokens are out; ``logit_bias`` adds to the
    # logits of token ids; ``allowed_token_ids`` restricts sampling to those ids; ``bad_words``
    # bans each word's last token where the output already ends with the rest of the word;
    # ``prompt_logprobs`` asks for each prompt token's log-probability plus that many top
    # alternatives (computed, never read from the prefix cache).
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    prompt_logprobs: int | None = None
    # Structured outputs: what the output must match (``structured/`` compiles and enforces it).
    constraint: OutputConstraint | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers and keep the frozen value hashable.
        stop = self.stop
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, tuple | list):
            raise ValueError(f"stop must be a string or a list of strings; got {stop!r:.80}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, tuple | list):
            raise ValueError(f"stop_token_ids must be a list of integers; got {ids!r:.80}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if GREEDY_BELOW <= self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1, INT64_MAX, none="None (no limit)")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("max_tokens", self.max_tokens, 1, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        if len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop must have at most {MAX_STOPS} strings; got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(
                    f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} "
                    f"characters; got {s!r:.80}"
                )
        if len(self.stop_token_ids) > MAX_STOPS:
            raise ValueError(
                f"stop_token_ids must have at most {MAX_STOPS} ids; got {len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, INT64_MAX)
        self._check_extensions()
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r:.80}")

    def _check_extensions(self) -> None:
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            MAX_REPETITION_PENALTY,
            open_low=True,
        )
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        if not isinstance(bias, tuple | list) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
        for pair in bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias); got {pair!r:.80}")
            _check_int("logit_bias", pair[0], 0, INT64_MAX)
            _check_float("logit_bias", pair[1], -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, tuple | list) or not allowed:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for t in allowed:
                _check_int("allowed_token_ids", t, 0, INT64_MAX)
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        words = self.bad_words
        words = (words,) if isinstance(words, str) else words
        if not isinstance(words, tuple | list) or len(words) > MAX_STOPS:
            raise ValueError(f"bad_words must be a list of at most {MAX_STOPS} strings")
        for w in words:
            if not isinstance(w, str) or not 0 < len(w) <= MAX_STOP_CHARS:
                raise ValueError(f"bad_words must be non-empty strings; got {w!r:.80}")
        object.__setattr__(self, "bad_words", tuple(words))
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise ValueError(f"constraint must be an OutputConstraint; got {self.constraint!r:.80}")

    @property
    def constrained(self) -> bool:
        """Anything that edits the logits before the pick (besides the two penalties)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
            or self.constraint is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing else to compute: no penalties, no logprobs (the sampler's one
        batched argmax serves such rows)."""
        return (
            self.temperature < GREEDY_BELOW
            and self.logprobs is None
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.constrained
            and self.prompt_logprobs is None
        )


def _check_int(name: str, value: object, low: int, high: int | None, *, none: str = "") -> None:
    """``low <= value <= high`` for a true int (not a bool, float or string)."""
    span = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if none:
        span += f" or {none}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer {span}; got {value!r:.80}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {span}; got {value}")


def _check_float(
    name: str, value: object, low: float, high: float, *, open_low: bool = False
) -> None:
    """A finite real number (ints allowed, bools not) in [low, high] or (low, high]."""
    span = f"{'(' if open_low else '['}{low:g}, {high:g}]"
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ValueError(f"{name} must be a finite number in {span}; got {value!r:.80}")
    if value > high or value < low or (open_low and value == low):
        raise ValueError(f"{name} must be in {span}; got {value}")
