"""Tests of quire_engine.bench: every benchmark in CI size (no timing asserted)."""
