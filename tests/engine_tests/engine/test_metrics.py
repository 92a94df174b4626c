"""``BatchHistogram`` is exposed exactly like ``prometheus_client.Histogram`` fed the same
observations one by one (bucket counts, ``le`` labels, count; the sum within float rounding),
including values that sit exactly on a bucket bound (``le`` is inclusive), under each of its
exposures with that exposure's own buckets. ``GcPauses`` observes
each collection in its generation's series and stops observing once closed."""

from __future__ import annotations

import gc
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from quire_engine.engine.histogram import BatchHistogram, Exposure
from quire_engine.engine.metrics import ITL_BUCKETS, TTFT_BUCKETS, GcPauses


def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_batch_histogram_matches_the_client_histogram() -> None:
    rng = random.Random(0)
    values = [rng.choice(ITL_BUCKETS) for _ in range(40)]  # on the bounds: le is inclusive
    values += [rng.uniform(0, 3) for _ in range(200)] + [0.0, 7.5, 1e-9]
    steps = [values[i : i + 17] for i in range(0, len(values), 17)]

    plain_reg, batch_reg = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("lat_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=plain_reg)
    other = Histogram("b:lat_seconds", "doc", ["m", "e"], buckets=TTFT_BUCKETS, registry=plain_reg)
    batch = BatchHistogram(
        [
            Exposure("lat_seconds", "doc", ITL_BUCKETS, (("model_name", "m"),)),
            Exposure("b:lat_seconds", "doc", TTFT_BUCKETS, (("m", "m"), ("e", "0"))),
        ],
        batch_reg,
    )
    for k, step in enumerate(steps):
        counts: dict[float, int] = {}
        for v in step:
            plain.labels("m").observe(v)
            other.labels("m", "0").observe(v)
            counts[v] = counts.get(v, 0) + 1
        if k % 2:
            batch.observe_many(counts)
        else:
            for v in step:
                batch.observe(v)

    want, got = samples(plain_reg), samples(batch_reg)
    assert set(got) == set(want)
    for key, value in want.items():
        if key[0].endswith("_sum"):
            assert got[key] == pytest.approx(value, rel=1e-12)
        else:
            assert got[key] == value, key
    assert got[("lat_seconds_count", "")] == got[("b:lat_seconds_count", "")] == len(values)


def test_bounds_given_later_only_before_the_first_observation() -> None:
    registry = CollectorRegistry()
    batch = BatchHistogram([Exposure("tokens", "doc", (), (("model_name", "m"),))], registry)
    assert registry.get_sample_value("tokens_bucket", {"model_name": "m", "le": "+Inf"}) == 0
    batch.set_bounds((1.0, 2.0, 5.0))
    batch.observe(2)
    assert registry.get_sample_value("tokens_bucket", {"model_name": "m", "le": "2.0"}) == 1
    assert registry.get_sample_value("tokens_bucket", {"model_name": "m", "le": "1.0"}) == 0
    with pytest.raises(RuntimeError, match="before the first observation"):
        batch.set_bounds((1.0,))


def test_gc_pauses_are_observed_by_generation_until_closed() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses(registry, "m")

    def count(generation: str) -> float:
        value = registry.get_sample_value(
            "quire_gc_pause_seconds_count", {"model_name": "m", "generation": generation}
        )
        assert value is not None
        return value

    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        assert count("0") >= 1 and count("2") >= 2  # more if allocations triggered their own
        sum_2 = registry.get_sample_value(
            "quire_gc_pause_seconds_sum", {"model_name": "m", "generation": "2"}
        )
        assert sum_2 is not None and sum_2 > 0
    finally:
        pauses.close()
    full = count("2")
    gc.collect(2)
    assert count("2") == full
    pauses.close()  # idempotent
