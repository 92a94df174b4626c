"""``bench lora`` in miniature: one JSON object with the base model's rate, each mix's rate and
ratio, and the adapter load figures. No timing is asserted."""

from __future__ import annotations

import argparse

from quire_engine.bench import lora


def test_the_bench_reports_every_mix_against_the_base_model() -> None:
    parser = argparse.ArgumentParser()
    lora.add_arguments(parser)
    argv = "--preset tiny --adapters 1,3 --rank 4 --requests 6 --prompt-len 12 --output-len 3"
    out = lora.run(parser.parse_args([*argv.split(), "--repeats", "1"]))
    assert set(out["tokens_per_s"]) == {"base", "1_adapters", "3_adapters"}
    assert all(rate > 0 for rate in out["tokens_per_s"].values())
    assert set(out["ratios_over_base"]) == {"1_adapters", "3_adapters"}
    assert set(out["load"]) == {"adapter_mb", "read_ms_p50", "slot_copy_ms_p50"}
    # Rank 4 on the 7 projections of the tiny model's 2 layers, float32.
    assert out["load"]["adapter_mb"] > 0
