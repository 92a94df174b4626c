"""``benchmarks/ab.py`` compares two versions on one benchmark: exported base, alternating runs,
best and median per numeric key."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from quire_engine.cpu import native
from tests.engine_tests.toolchain import require_native_kernels

REPO = Path(__file__).resolve().parents[3]


def _load(name: str = "ab") -> ModuleType:
    """A script of ``benchmarks/`` as a module (they import each other by file name)."""
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"quire_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rates_are_better_higher_and_times_lower() -> None:
    ab = _load()
    rates = ["quire_tok_s", "x.output_tokens_per_cpu_s", "ratio_vs_offline", "throughput"]
    measures = ["tiny.ready.median_s", "duration_s", "step_us_p50", "peak_mib", "server_cpu_s"]
    assert [ab.higher_is_better(k) for k in rates] == [True] * len(rates)
    assert [ab.higher_is_better(k) for k in measures] == [False] * len(measures)


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


def _head() -> str:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _fake_kernel(value: float) -> Any:
    """A stand-in for a native decoder build: fills the step's logits with ``value``."""

    def kernel(args: Any) -> None:  # a native.DecoderArgs
        n, vocab, at = args.n, args.vocab, args.logits
        pointer = ctypes.cast(at, ctypes.POINTER(ctypes.c_float))
        np.ctypeslib.as_array(pointer, shape=(n, vocab))[:] = value

    return kernel


def test_native_ab_times_both_builds_and_refuses_different_results() -> None:
    native_ab = _load("native_ab")
    logits = torch.zeros(3, 5)
    args = native.DecoderArgs(vocab=5, n=3, logits=logits.data_ptr())
    same = native_ab.Paired(_fake_kernel(1.0), _fake_kernel(1.0))
    same(args)
    same(args)  # the other build first
    assert [n for n, _, _ in same.steps] == [3, 3] and torch.equal(logits, torch.ones(3, 5))
    got = native_ab.report([(1, 2.0, 1.0), (3, 1.0, 1.5), (3, 1.0, 0.5), (40, 4.0, 2.0)])
    assert got["1"] == {
        "steps": 1, "base_s": 2.0, "head_s": 1.0, "head_vs_base": 0.5, "median_step_ratio": 0.5
    }  # fmt: skip
    assert got["2-4"]["head_vs_base"] == 1.0 and got["2-4"]["median_step_ratio"] == 1.0
    assert got["all"]["steps"] == 4 and got["all"]["head_vs_base"] == 0.625
    assert "5-16" not in got  # no steps of that size
    differ = native_ab.Paired(_fake_kernel(1.0), _fake_kernel(2.0))
    with pytest.raises(SystemExit, match="different logits"):
        differ(args)
    # --rtol: rounding apart is accepted (a summation order change), more is not.
    close = native_ab.Paired(_fake_kernel(1.0), _fake_kernel(1.0 + 2**-20), rtol=1e-5)
    close(args)
    close(args)
    assert len(close.steps) == 2
    with pytest.raises(SystemExit, match="beyond --rtol"):
        native_ab.Paired(_fake_kernel(1.0), _fake_kernel(1.001), rtol=1e-5)(args)


def test_native_ab_refuses_builds_with_another_entry_point(tmp_path: Path) -> None:
    native_ab = _load("native_ab")
    csrc = REPO / "engine/quire_engine/cpu/csrc"
    changed = tmp_path / "engine/quire_engine/cpu/csrc"
    changed.mkdir(parents=True)
    shutil.copy(csrc / "decoder_decode.c", changed / "decoder_decode.c")
    text = (csrc / "quire_native.h").read_text()
    # The entry point takes a struct: a field dropped from it changes the entry point.
    dropped = text.replace("    int64_t n; ", "    ", 1)
    assert dropped != text
    (changed / "quire_native.h").write_text(dropped)
    assert native_ab.prototype(tmp_path) != native_ab.prototype(REPO)
    with pytest.raises(SystemExit, match="parameters differ"):
        native_ab.main(["--base", _head(), "--head", str(tmp_path)])


def test_native_ab_pairs_every_native_step(capsys: pytest.CaptureFixture[str]) -> None:
    require_native_kernels()
    native_ab = _load("native_ab")
    argv = ["--base", _head(), "--", "--layers", "1", "--hidden-size", "64"]
    assert native_ab.main([*argv, "--num-requests", "6", "--budget-seqs", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    classes = [v for k, v in report.items() if isinstance(v, dict) and k != "all"]
    assert report["all"]["steps"] == sum(c["steps"] for c in classes) > 0
    assert report["all"]["base_s"] > 0 and report["all"]["head_s"] > 0
