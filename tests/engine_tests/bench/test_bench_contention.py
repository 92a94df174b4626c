"""``quire-engine bench contention`` at a tiny size, for its JSON shape only: one thread, no
neighbour, both wait policies, each run in a child process. Speeds are what the benchmark
measures, not what is asserted."""

from __future__ import annotations

import json

import pytest

from quire_engine.cli import main


@pytest.mark.slow
def test_bench_contention_reports_runs_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--layers", "1", "--hidden-size", "128", "--num-requests", "2"]
    argv = ["bench", "contention", "--json", "--threads", "1", "--neighbours", "0", *tiny]
    assert main([*argv, "--mean-prompt", "8", "--mean-output", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["threads"], out["neighbours"]) == (1, 0)
    assert [(r["neighbours"], r["threads"], r["policy"]) for r in out["runs"]] == [
        (0, 1, "before"),
        (0, 1, "after"),
    ]
    for run in out["runs"]:
        assert set(run) == {
            "neighbours", "threads", "policy", "tok_s", "tok_per_cpu_s", "engine_threads"
        }  # fmt: skip
        assert run["engine_threads"] == 1
    assert set(out["ratios"]) == {"neighbours_0"}
    assert set(out["ratios"]["neighbours_0"]) == {"threads_over_one", "after_over_before"}
    assert out["outputs_identical"] is True


def test_bench_contention_refuses_zero_threads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "contention", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
