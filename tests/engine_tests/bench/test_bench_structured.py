"""``bench structured`` runs end to end and reports what it promises (no timing assertions)."""

from __future__ import annotations

import argparse

from quire_engine.bench import structured


def test_bench_structured_reports_its_figures() -> None:
    parser = argparse.ArgumentParser()
    structured.add_arguments(parser)
    out = structured.run(parser.parse_args(["--batch", "4", "--output", "8", "--schemas", "5"]))
    assert out["unconstrained_tok_s"] > 0 and out["constrained_tok_s"] > 0
    assert out["compile_ms_p99"] >= out["compile_ms_p50"] > 0
    assert out["ttft_ms_first_seen_schema"] > 0 and out["ttft_ms_cached_schema"] > 0
