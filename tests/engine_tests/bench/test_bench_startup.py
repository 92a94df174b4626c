"""``quire-engine bench startup`` in CI size: one cold start of a real ``quire-engine serve``
child process per preset (the embedded model and the saved 32m Llama), each answering a first
streamed completion; the report holds every phase the server exported and the client's view.
Speeds are what the benchmark measures, not what is asserted here."""

from __future__ import annotations

import json

import pytest

from quire_engine.cli import main

PHASES = {"imports", "weights", "kv_profile", "kv_allocate", "warmup", "ready"}
CLIENT = {"client_ready", "client_first_token"}


@pytest.mark.slow
def test_bench_startup_reports_every_phase_of_each_preset(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "startup", "--json", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["repeats"] == 1 and set(out["presets"]) == {"tiny", "32m"}
    for preset, report in out["presets"].items():
        assert set(report) == PHASES | CLIENT, preset
        for key, stats in report.items():
            assert set(stats) == {"median_s", "min_s"}
            assert stats["min_s"] == stats["median_s"] >= 0.0, (preset, key)
        # The phases add up to at most ready (rounded to milliseconds each).
        total = sum(report[p]["median_s"] for p in PHASES - {"ready"})
        assert total <= report["ready"]["median_s"] + 0.005
        assert report["client_first_token"]["median_s"] >= report["client_ready"]["median_s"]


def test_bench_startup_refuses_unknown_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "startup", "--presets", "tiny,7b"]) == 2
    assert "--presets: choose from tiny, 32m" in capsys.readouterr().err
    assert main(["bench", "startup", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
