"""Tests of quire_engine.engine: the engine step, faults, errors, metrics and start-up."""
