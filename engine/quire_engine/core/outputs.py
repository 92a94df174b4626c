"""What ``LLM.generate`` and the engine return: plain data, no tensors.

A request's output is cumulative, and the engine reports every request that progressed after
every step. Copying each sample's token list into every report would cost O(length) per step per
sequence (O(length²) per request: 300 µs per step for 256 sequences of 200 tokens). Unfinished
reports therefore carry a ``Prefix``, a read-only view of the first ``n`` items of the sample's
append-only list, made in constant time; a finished sample's report carries a plain list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, TypeVar, overload

from quire_engine.core.sequence import FinishReason

_T = TypeVar("_T")


class Prefix(Sequence[_T], Generic[_T]):
    """The first ``n`` items of an append-only list, frozen at ``n``.

    Ownership: the list belongs to the engine thread, which only ever appends to it; readers on
    other threads see exactly ``n`` items however long the list has grown since (appending never
    moves an index, and CPython reads a list item atomically). Compares equal to a list or tuple
    with the same items."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[_T], n: int) -> None:
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> _T: ...
    @overload
    def __getitem__(self, index: slice) -> list[_T]: ...
    def __getitem__(self, index: int | slice) -> _T | list[_T]:
        if isinstance(index, slice):
            return self._items[: self._n][index]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[_T]:
        return islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Prefix | list | tuple):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=False))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. ``logprobs`` (when asked) has one dict per generated token mapping
    token id -> log-probability: the sampled token plus the top alternatives."""

    index: int
    text: str = ""
    token_ids: Sequence[int] = field(default_factory=list)  # a list, or a Prefix in reports
    cumulative_logprob: float | None = None
    logprobs: Sequence[dict[int, float]] | None = None  # likewise
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Cumulative output of one request. ``error`` is set when the request failed on its own (an
    internal error in its sampling, detokenization, stop checks or beam step): it is then
    finished, its samples end with ``finish_reason`` "abort", and the engine went on.
    ``num_cached_tokens``: prompt tokens found in the prefix cache when it was first scheduled
    (vLLM's field of the same name). ``prompt_logprobs``, when asked for: one entry per prompt
    token (None for the first), mapping token id -> log-probability (the prompt's own token plus
    the top alternatives)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
