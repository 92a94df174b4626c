"""``benchmarks/ab.py`` compares two versions on one benchmark: exported base, alternating runs,
best and median per numeric key."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str = "ab") -> ModuleType:
    """A script of ``benchmarks/`` as a module (they import each other by file name)."""
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"quire_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_keeps_the_best_in_the_right_direction() -> None:
    ab = _load()
    runs = [
        {"256": {"step_us_p50": 120.0}, "quire_tok_s": 200.0, "ok": True},
        {"256": {"step_us_p50": 100.0}, "quire_tok_s": 250.0, "ok": False},
        {"256": {"step_us_p50": 300.0}, "quire_tok_s": 150.0, "ok": True},
    ]
    got = ab.summarize(runs, None)
    assert got["256.step_us_p50"] == {"best": 100.0, "median": 120.0, "runs": [120.0, 100.0, 300.0]}
    assert got["quire_tok_s"]["best"] == 250.0  # a rate: higher is better
    assert "ok" not in got  # booleans are not measurements
    assert set(ab.summarize(runs, "p50")) == {"256.step_us_p50"}


def test_compares_a_revision_with_this_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    ab = _load()
    argv = ["--base", head, "--runs", "1", "--key", "step_us", "--"]
    assert ab.main([*argv, "bench", "scheduler", "--json", "--steps", "20"]) == 0
    report = json.loads(capsys.readouterr().out)
    entry = report["step_us_p50"]
    assert entry["base"]["runs"] and entry["head"]["runs"] and entry["head_vs_base"] > 0


def test_instruction_counts_are_read_from_cachegrind_and_differenced() -> None:
    ir = _load("instructions")
    stderr = "==1== Collected : 12\n==1==\n==1== I   refs:      19,121,222,455\n"
    assert ir.parse_refs(stderr) == 19_121_222_455
    with pytest.raises(ValueError, match="I refs"):
        ir.parse_refs("valgrind: command not found")
    assert ir.per_step(1_000, 5_000, 100) == 40.0
    with pytest.raises(ValueError):
        ir.per_step(5_000, 5_000, 100)  # the longer run must count more
