"""``bench kv_offload`` in miniature: one JSON object with the tier off and on per workload;
the tier hits (and computes fewer prompt tokens) where prompts come back after eviction, and
hits nothing where no prompt repeats. No timing is asserted."""

from __future__ import annotations

import argparse

from quire_engine.bench import kv_offload


def test_the_tier_hits_where_prompts_return_and_nowhere_else() -> None:
    parser = argparse.ArgumentParser()
    kv_offload.add_arguments(parser)
    flags = {
        "--num-blocks": 12, "--conversations": 3, "--turns": 2, "--turn-tokens": 48,
        "--systems": 3, "--uses": 2, "--system-tokens": 96, "--output-tokens": 4, "--repeats": 1,
    }  # fmt: skip
    args = parser.parse_args([str(x) for item in flags.items() for x in item])
    out = kv_offload.run(args)
    assert out["tier_blocks"] == 8 * 12
    for name in ("multi_turn", "shared_system"):
        off, on = out[name]["tier_off"], out[name]["tier_on"]
        assert off["host_hit_rate"] == 0 and on["host_hit_rate"] > 0, name
        assert on["prompt_tokens"] == off["prompt_tokens"]
        assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"], name
        assert on["blocks_loaded"] > 0 and off["blocks_loaded"] == 0
    off, on = out["no_hit"]["tier_off"], out["no_hit"]["tier_on"]
    # (A request preempted by recompute may load its own spilled blocks back: not a prompt hit.)
    assert on["host_hit_rate"] == 0 and on["blocks_offloaded"] > 0
    assert on["prompt_tokens_computed"] == off["prompt_tokens_computed"] == off["prompt_tokens"]
    assert set(out["multi_turn"]["ratios"]) == {
        "ttft_p50_on_over_off",
        "ttft_p99_on_over_off",
        "prompt_tokens_computed_on_over_off",
        "tokens_per_s_on_over_off",
    }
