"""The seam that instrumentation watches the engine's steps through.

An observer added with ``LLMEngine.add_observer`` is called after every step, on the engine's
thread, with a ``StepRecord``: the step's schedule and the thread CPU time the step took (from
scheduling to the reports). The profile (``engine/profile``), the roofline's step log
(``bench/roofline``) and ``serve --profile`` read steps this way instead of replacing engine or
runner methods; timing inside the forward goes through the runner's own hook
(``ModelRunner.forward_observer``). Without observers the engine reads no clock.

Ownership: the engine holds its observers (a tuple, replaced on add and remove, so a step never
sees the set change under it); an observer owns what it records.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from quire_engine.core.scheduler import SchedulerOutput


class StepRecord(NamedTuple):
    """One engine step, as its observers see it."""

    schedule: SchedulerOutput  # what the step ran (empty: nothing was scheduled)
    cpu_ns: int  # thread CPU nanoseconds of the whole step


class StepObserver(Protocol):
    def on_step(self, step: StepRecord) -> None:
        """Called after each step (not after a step that raised: the engine is then dead)."""
