"""What ``LLM.generate`` and the engine return: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``logprobs`` (when asked) has one dict per generated token mapping
    token id -> log-probability: the sampled token plus the top alternatives."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Cumulative output of one request. ``error`` is set when the request failed on its own (an
    internal error in its sampling, detokenization, stop checks or beam step): it is then
    finished, its samples end with ``finish_reason`` "abort", and the engine went on."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
