"""Tests of quire_engine.core: the pure-Python scheduler, block pool, KV cache manager, configs
and outputs."""
