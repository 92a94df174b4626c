"""What a submitter holds for one HTTP request: a ``RequestHandle`` over the engine requests of its
prompts, fed through a ``Sink``.

Ownership: the event loop owns both. The ``AsyncEngine`` routes each engine output into the sink
of its request (``put``), or fails the sink when the engine cannot go on (``fail`` with
``EngineUnavailable``). The submitter iterates ``outputs()`` and must call ``abort()`` when it
stops listening; ``abort`` hands the unfinished ids to the engine's abort callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from quire_engine.core.outputs import RequestOutput


class EngineUnavailable(Exception):
    """The request cannot be taken now (HTTP 503); ``retry_after`` seconds is a fair wait."""

    def __init__(self, message: str, *, code: str, retry_after: int) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


class Sink:
    """Event-loop side of one HTTP request: the latest output of each of its prompts."""

    __slots__ = ("aborted", "error", "event", "latest")

    def __init__(self) -> None:
        self.latest: dict[int, RequestOutput] = {}
        self.event = asyncio.Event()
        self.error: BaseException | None = None
        self.aborted = False

    def put(self, index: int, output: RequestOutput) -> None:
        self.latest[index] = output
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()


class RequestHandle:
    """The engine requests (one per prompt) of one HTTP request."""

    def __init__(
        self, abort: Callable[[list[str]], None], request_ids: list[str], sink: Sink
    ) -> None:
        self._abort = abort
        self._ids = request_ids
        self._sink = sink
        self._pending = set(range(len(request_ids)))
        self.error: str | None = None  # the first prompt that failed inside the engine, if any

    @property
    def aborted(self) -> bool:
        return self._sink.aborted

    def abort(self) -> None:
        """Stop every unfinished prompt and free its blocks. Idempotent and synchronous, so it is
        safe in ``finally`` blocks of cancelled tasks and in done-callbacks."""
        if not self._pending or self._sink.aborted:
            return
        self._sink.aborted = True
        self._sink.event.set()
        self._abort([self._ids[i] for i in self._pending])

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, cumulative output)`` until every prompt finished; stops early (without
        an error) once ``abort()`` was called; raises ``EngineUnavailable`` if the engine stops."""
        sink = self._sink
        while self._pending:
            await sink.event.wait()
            sink.event.clear()
            if sink.aborted:
                return
            if sink.error is not None:
                raise sink.error
            batch, sink.latest = sink.latest, {}
            for index in sorted(batch):
                output = batch[index]
                if output.finished:
                    self._pending.discard(index)
                if output.error is not None and self.error is None:
                    self.error = output.error
                yield index, output
