"""Benchmarks behind ``quire-engine bench``; each prints one JSON object."""
