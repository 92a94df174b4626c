"""Tests of quire_engine.structured: grammar-constrained outputs."""
