"""The state of one beam-search request: its live beams, their scores, the candidates that have
arrived this step and the finished hypotheses. Owned by the request (``Request.beam``), written
by the engine (candidates) and by ``core.beam_search`` (everything else). Pure data."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from quire_engine.core.sequence import FinishReason


class TopTokens(NamedTuple):
    """A beam's best next tokens, best first: log-probabilities and their token ids."""

    logprobs: list[float]
    token_ids: list[int]


@dataclass(slots=True)
class BeamState:
    width: int
    ignore_eos: bool
    active: list[str] = field(default_factory=list)  # sequence ids of live beams
    cumulative: dict[str, float] = field(default_factory=dict)
    pending: dict[str, TopTokens] = field(default_factory=dict)  # seq id -> its best tokens
    finished: list[tuple[list[int], float, FinishReason]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"beam_width must be >= 1; got {self.width}")

    @property
    def ready(self) -> bool:
        return bool(self.active) and all(sid in self.pending for sid in self.active)

    @property
    def done(self) -> bool:
        return not self.active
