"""``quire-engine bench load`` in CI size: each loader builds the whole model in a child process
of its own and reports seconds and peak resident memory; the report pairs ``direct`` with
``transformers``. Speeds and memory are what the benchmark measures, not what is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quire_engine.cli import main


@pytest.mark.slow
def test_bench_load_reports_each_loader(
    capsys: pytest.CaptureFixture[str], model_dirs: dict[str, Path]
) -> None:
    argv = ["bench", "load", "--json", "--model", str(model_dirs["llama"]), "--repeats", "1"]
    assert main([*argv, "--loaders", "transformers,direct", "--dtypes", "float32,bfloat16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["repeats"] == 1 and out["not_installed"] == []
    assert out["checkpoint_mib"] > 0
    for dtype in ("float32", "bfloat16"):
        report = out["dtypes"][dtype]
        assert set(report) == {"transformers", "direct", "direct_vs_transformers"}
        for loader in ("transformers", "direct"):
            assert set(report[loader]) == {"median_s", "min_s", "median_peak_mib"}
            assert report[loader]["median_s"] > 0
        assert set(report["direct_vs_transformers"]) == {"time", "peak"}


def test_bench_load_refuses_unknown_loaders(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "load", "--loaders", "direct,pickle"]) == 2
    assert "--loaders: choose from transformers, direct" in capsys.readouterr().err
