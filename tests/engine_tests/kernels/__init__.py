"""Tests of quire_engine.kernels: the Triton kernels against their torch references."""
