"""Tests of quire_engine.parallel: tensor parallelism over processes and nodes."""
