"""One measured distribution exposed as one or more Prometheus histograms.

``BatchHistogram`` keeps a single count and sum and, per exposed family, its own bucket counts:
Quire's ``quire_*`` family and, when the server also speaks vLLM's protocol, the ``vllm:*`` family
of the same measurement with vLLM's name, bucket bounds and labels. One ``observe`` updates every
family under one lock, so the two families always carry the same observations and a second family
costs a bisection per value, not a second histogram object.

Ownership: the engine thread (``StatsRecorder``) is the only writer; scrapes read a copy taken
under the same lock, so a scrape never sees a step half applied.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric


class Exposure(NamedTuple):
    """How one family shows the measurement: name, help text, finite upper bounds (ascending;
    ``+Inf`` is implied) and its constant labels as (name, value) pairs."""

    name: str
    documentation: str
    bounds: tuple[float, ...]
    labels: tuple[tuple[str, str], ...]


class BatchHistogram:
    """A Prometheus histogram that takes many equal observations at once (``observe_many``), and
    can be exposed under several names with different buckets (``Exposure``).

    The inter-token latency has one observation per running sample per step, and within a step
    most of them are equal (the time since the previous step). ``prometheus_client.Histogram``
    costs one call, a scan of the bounds and two locks per observation (about 1.4 ms per step at
    256 sequences, more than the step itself); here a step's observations are grouped by value
    and applied under one lock. Exposed like ``Histogram`` (``_bucket`` with ``le``, ``_count``,
    ``_sum``).

    An exposure may be declared without bounds (``()``) when they are only known later (token
    counts bucketed up to ``max_model_len``): ``set_bounds`` gives them once, before the first
    observation; until then that family has the ``+Inf`` bucket only."""

    def __init__(self, exposures: Sequence[Exposure], registry: CollectorRegistry) -> None:
        if not exposures:
            raise ValueError("a histogram needs at least one exposure")
        self.exposures = [_checked(e) for e in exposures]
        self._bounds = [list(e.bounds) for e in self.exposures]
        # Per exposure, per bucket (not cumulative); the last one is +Inf.
        self._counts = [[0] * (len(b) + 1) for b in self._bounds]
        self._count = 0
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    @property
    def name(self) -> str:
        return self.exposures[0].name

    def set_bounds(self, bounds: tuple[float, ...]) -> None:
        """Give every exposure declared without bounds these bounds; only before the first
        observation (buckets cannot be split after the fact)."""
        with self._lock:
            if self._count:
                raise RuntimeError(f"{self.name}: bounds must be set before the first observation")
            for k, exposure in enumerate(self.exposures):
                if not exposure.bounds:
                    self.exposures[k] = _checked(exposure._replace(bounds=tuple(bounds)))
                    self._bounds[k] = list(self.exposures[k].bounds)
                    self._counts[k] = [0] * (len(bounds) + 1)

    def observe(self, value: float) -> None:
        with self._lock:
            for bounds, counts in zip(self._bounds, self._counts, strict=True):
                counts[bisect.bisect_left(bounds, value)] += 1  # le: value <= bound
            self._count += 1
            self._sum += value

    def observe_many(self, counts: dict[float, int]) -> None:
        """Observe each value ``counts[value]`` times."""
        with self._lock:
            for bounds, buckets in zip(self._bounds, self._counts, strict=True):
                for value, n in counts.items():
                    buckets[bisect.bisect_left(bounds, value)] += n
            for value, n in counts.items():
                self._count += n
                self._sum += value * n

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts = [list(c) for c in self._counts]
            bounds = [list(b) for b in self._bounds]
            total = self._sum
            exposures = list(self.exposures)
        families = []
        for exposure, upper, per_bucket in zip(exposures, bounds, counts, strict=True):
            names = [label for label, _ in exposure.labels]
            family = HistogramMetricFamily(exposure.name, exposure.documentation, labels=names)
            cumulative, buckets = 0, []
            for bound, n in zip([*upper, float("inf")], per_bucket, strict=True):
                cumulative += n
                buckets.append((le_text(bound), float(cumulative)))
            family.add_metric([value for _, value in exposure.labels], buckets, total)
            families.append(family)
        return families


def le_text(bound: float) -> str:
    """A bucket bound as Prometheus client libraries write it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts."""
    bounds: list[float] = []
    power = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * power > max_value:
                return tuple(bounds)
            bounds.append(float(mantissa * power))
        power *= 10


def _checked(exposure: Exposure) -> Exposure:
    bounds = tuple(float(b) for b in exposure.bounds if b != float("inf"))
    if any(b >= c for b, c in itertools.pairwise(bounds)):
        raise ValueError(f"{exposure.name}: bucket bounds must be ascending; got {bounds}")
    return exposure._replace(bounds=bounds)
