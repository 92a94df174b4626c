"""``quire-engine bench serve`` with its peers in CI size: it launches a real ``quire-engine
serve`` and ``transformers serve --continuous-batching`` on loopback (one after the other, the
same model and KV budget), runs the offline peer, and reports every request completed with the
exact token counts and the ratios (speed is measured by the benchmark, not asserted here), the
Quire server's garbage-collector pauses and, with ``--profile``, its step split, both read from
its ``/metrics``."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from quire_engine.cli import main
from quire_engine.cpu import native

SMALL = [
    "--hidden-size", "64", "--layers", "1", "--num-prompts", "5", "--mean-prompt-len", "12",
    "--mean-output-len", "6", "--max-model-len", "64", "--kv-budget", "256",
    "--max-concurrency", "3",
]  # fmt: skip


@pytest.mark.slow
def test_serve_bench_launches_peers(capsys: pytest.CaptureFixture[str]) -> None:
    systems = "quire,transformers" if importlib.util.find_spec("accelerate") else "quire"
    argv = ["bench", "serve", "--json", "--launch", systems, "--offline", "--profile", *SMALL]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = out["output_tokens"]
    assert expected > 0 and out["prompt_format"] == ("text" if "," in systems else "ids")
    for system in systems.split(","):
        report = out[system]
        assert report["completed"] == 5 and report["failed"] == 0, report["errors"]
        assert report["total_output_tokens"] == expected
        assert report["p99_ttft_ms"] is not None
    # --profile: the Quire server ran with serve --profile; its steps over the run, split.
    profile = out["quire"]["profile"]
    assert profile["steps"] > 0 and profile["step_cpu_s"] > 0
    phases = {"matmuls", "attention", "forward_other", "native_decoder", "step_python"}
    assert set(profile["split_s"]) == phases
    # Prefill runs the modules; decode steps of a few sequences the native decoder.
    assert profile["split_s"]["matmuls"] > 0 and profile["split_s"]["attention"] > 0
    # Locally the native kernels may not build (no compiler); in CI they must.
    if native.library() is not None or os.environ.get("CI") == "true":
        assert profile["split_s"]["native_decoder"] > 0
    assert "server_cpu_outside_steps_s" in profile
    if "," in systems:
        assert "profile" not in out["transformers"]  # exports no quire_profile_* counters
        assert "server_gc_pauses" not in out["transformers"]
    # The Quire server's collector pauses over the run, read from quire_gc_pause_seconds.
    pauses = out["quire"]["server_gc_pauses"]
    assert set(pauses) == {"0", "1", "2"}
    # Differences over the run: whether a collection ran in five tiny requests is up to the
    # allocator, so only the shape and the sign are checked.
    assert all(set(p) == {"count", "sum_s", "over_50ms"} for p in pauses.values())
    assert all(v >= 0 for p in pauses.values() for v in p.values())
    assert out["offline"]["total_output_tokens"] == expected
    assert out["ratio_vs_offline"] > 0
    # The roofline of the offline run's steps, and each server's duration over it.
    floor = out["floor"]
    assert floor["steps"] > 0 and floor["floor_s"] > 0 and floor["vs_floor"] > 0
    for system in systems.split(","):
        assert floor[f"{system}_vs_floor"] > 0
    assert ("max_ratio_vs_transformers" in floor) == ("," in systems)
    assert "max_ratio_vs_quire" not in floor
    if "," in systems:
        assert out["ratio_vs_transformers"] > 0


def test_serve_bench_rejects_unknown_servers() -> None:
    assert main(["bench", "serve", "--launch", "vllm", *SMALL]) == 2
