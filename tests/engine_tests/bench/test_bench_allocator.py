"""The allocator and scheduler benchmarks: JSON shape and the memory results (deterministic,
seeded replays; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from quire_engine.cli import main


def run_cli(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "quire_engine.cli", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


def test_allocator_paged_vs_contiguous_meets_paper_targets() -> None:
    result = run_cli("bench", "allocator", "--json", "--num-requests", "400")
    assert result["block_size"] == 16
    assert result["paged"]["utilization"] >= 0.97
    assert result["contiguous"]["utilization"] < 0.4  # the paper: 20-38%
    assert result["concurrency_ratio"] >= 4
    assert result["paged"]["max_concurrent"] > result["contiguous"]["max_concurrent"]


def test_allocator_block_size_sweep_shows_tradeoff() -> None:
    result = run_cli("bench", "allocator", "--json", "--sweep", "--num-requests", "200")
    sizes = [r["block_size"] for r in result["sweep"]]
    utils = [r["paged"]["utilization"] for r in result["sweep"]]
    assert sizes == [8, 16, 32, 64, 128]
    assert utils == sorted(utils, reverse=True)  # bigger blocks waste more of the tail block


def test_shared_prefix_saves_memory() -> None:
    result = run_cli("bench", "allocator", "--json", "--shared-prefix", "--num-requests", "100")
    assert result["n"] == 4 and result["system_prompt_len"] == 1000
    shared, unshared = result["shared"], result["unshared"]
    assert shared["peak_blocks"] < unshared["peak_blocks"]
    # 1000 shared tokens of ~1060-token prompts, 4 samples: most of the memory is shareable.
    assert result["peak_blocks_saved_fraction"] > 0.5


def test_scheduler_bench_reports_percentiles(capsys: object) -> None:
    assert main(["bench", "scheduler", "--json", "--running", "32", "--steps", "50"]) == 0
    out = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert out["running"] == 32 and out["step_us_p50"] > 0
    assert out["step_us_p99"] >= out["step_us_p50"]


def test_bad_bench_input_is_a_clear_error(capsys: object) -> None:
    assert main(["bench", "allocator", "--block-size", "12"]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert "block_size must be a power of two" in err
