"""``quire-engine bench route`` against two real servers on loopback.

Here the "pool" and the "Service" are each one whole replica (server A and server B), so the
routing is known exactly: the benchmark's accounting is what is checked (requests per replica,
the prefix-hit rate read from the engines' counters, phases isolated from each other, the
low-load probes). Routing through a real gateway is the end-to-end tests' work (tests/e2e).
"""

from __future__ import annotations

import json

import pytest

from quire_engine.cli import main
from tests.engine_tests.live_server import serve, tiny_settings

GROUPS, PER_GROUP = 2, 3


@pytest.mark.slow
def test_route_bench_accounts_per_phase_and_replica(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(tiny_settings()) as a, serve(tiny_settings()) as b:
        argv = [
            "bench", "route", "--json", "--pool-url", a.url, "--service-url", b.url,
            "--engine-url", a.url, "--engine-url", b.url, "--groups", str(GROUPS),
            "--requests-per-group", str(PER_GROUP), "--system-prompt-len", "96",
            "--user-prompt-len", "8", "--output-len", "3", "--max-concurrency", "1",
            "--latency-probes", "3",
        ]  # fmt: skip
        assert main(argv) == 0
        a.wait_until_idle()
        b.wait_until_idle()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    total = GROUPS * PER_GROUP
    assert out["replicas"] == 2
    assert out["pool"]["requests_per_replica"] == [total, 0]
    assert out["service"]["requests_per_replica"] == [0, total]
    for phase in ("pool", "service"):
        report = out[phase]
        assert report["completed"] == total and report["failed"] == 0, report["errors"]
        # One request at a time: each group's first request misses, the others find the system
        # prompt's full blocks; the user suffix and the block it ends in never hit.
        assert 0 < report["prefix_hit_rate"] < 1
        assert report["p50_ttft_ms"] is not None
    # Same lengths, fresh text per phase, one replica each: nothing cached by the first phase
    # helps the second, so the two rates are equal (byte tokenizer: one token per character).
    assert out["pool"]["prefix_hit_rate"] == out["service"]["prefix_hit_rate"]
    assert out["ratios"]["prefix_hit_rate_pool_over_service"] == 1.0
    probes = out["low_load_latency"]
    assert probes["rounds"] == 3 and probes["failed"] == 0
    assert set(probes["added_p50_ms"]) == {"service", "pool"}


def test_route_bench_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "route", "--pool-url", "x", "--service-url", "y", "--engine-url", "z"]
    assert main([*argv, "--groups", "0"]) == 2
    assert "groups must be >= 1" in capsys.readouterr().err
