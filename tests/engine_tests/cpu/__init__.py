"""Tests of quire_engine.cpu: the CPU attention plan and the native kernels."""
