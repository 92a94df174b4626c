"""Tests of quire_engine.model: checkpoints, weights, the sampler, equivalence with
transformers."""
