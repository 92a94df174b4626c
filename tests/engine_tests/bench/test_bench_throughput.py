"""``quire-engine bench throughput`` in CI size: every system runs the same requests to the exact
token counts and the JSON has the documented keys, the roofline section included (speed is
measured by the benchmark, not asserted here)."""

from __future__ import annotations

import json

from quire_engine.cli import main


def test_throughput_bench_small(capsys: object) -> None:
    args = [
        "bench",
        "throughput",
        "--json",
        "--num-requests",
        "6",
        "--mean-prompt",
        "40",
        "--mean-output",
        "6",
        "--max-model-len",
        "64",
        "--budget-seqs",
        "2",
        "--hidden-size",
        "64",
        "--layers",
        "1",
        "--vocab-size",
        "300",
        "--profile",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[attr-defined]
    for key in (
        "quire_tok_s",
        "hf_static_tok_s",
        "hf_continuous_tok_s",
        "ratio_vs_static",
        "ratio_vs_continuous",
        "kv_budget_tokens",
        "model_params",
    ):
        assert key in out, key
    assert out["kv_budget_tokens"] == 128 and out["num_requests"] == 6
    assert out["quire_tok_s"] > 0 and out["hf_static_waves"] >= 1
    floor = out["floor"]  # the roofline of Quire's steps (bench.roofline)
    for key in ("steps", "floor_s", "vs_floor", "max_ratio_vs_static", "max_ratio_vs_continuous"):
        assert floor[key] > 0, key
    assert floor["weight_bytes_read"] == floor["weight_bytes_per_step"] * floor["steps"]
    # Every prompt is computed in full, as the peers (no prefix cache) compute it: the warm-up
    # shares no block with the workload, and the profiled rerun starts from a reset cache.
    assert out["prompt_tokens"] > 16 * out["num_requests"]  # full blocks a cache could revive
    assert out["quire_prefix_hit_tokens"] == 0
    profile = out["quire_profile"]
    assert profile["prefix_hit_tokens"] == 0 and profile["steps"] == floor["steps"]


def test_throughput_bench_tensor_parallel(capsys: object) -> None:
    """``--tensor-parallel-size 2`` adds the sharded run of the same requests and its split."""
    args = [
        "bench", "throughput", "--json", "--systems", "quire", "--tensor-parallel-size", "2",
        "--num-requests", "4", "--mean-prompt", "24", "--mean-output", "4",
        "--max-model-len", "64", "--budget-seqs", "2", "--hidden-size", "64", "--layers", "1",
        "--vocab-size", "300",
    ]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[attr-defined]
    tp = out["tensor_parallel"]
    assert tp["size"] == 2 and tp["steps"] > 0 and tp["tok_s"] > 0
    for key in ("speedup_vs_tp1", "collective_share", "plan_send_share", "plan_send_us_per_step"):
        assert tp[key] > 0, key


def test_throughput_bench_dtypes(capsys: object) -> None:
    """``--dtypes float32,bfloat16``: both runs on the same requests, each system's ratio."""
    args = [
        "bench", "throughput", "--json", "--systems", "quire,hf_static",
        "--dtypes", "float32,bfloat16", "--num-requests", "4", "--mean-prompt", "24",
        "--mean-output", "4", "--max-model-len", "64", "--budget-seqs", "2", "--hidden-size",
        "64", "--layers", "1", "--vocab-size", "300",
    ]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[attr-defined]
    assert out["dtypes"] == ["float32", "bfloat16"]
    fp32, bf16 = out["by_dtype"]["float32"], out["by_dtype"]["bfloat16"]
    assert fp32["dtype"] == "float32" and bf16["dtype"] == "bfloat16"
    assert fp32["output_tokens"] == bf16["output_tokens"]
    assert fp32["model_params"] == bf16["model_params"]
    for key in ("quire_bfloat16_vs_float32", "hf_static_bfloat16_vs_float32"):
        assert out["dtype_ratios"][key] > 0, key
        assert out["dtype_ratios"][f"{key}_per_cpu_s"] > 0, key
