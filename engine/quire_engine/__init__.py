"""Quire's LLM engine: a paged KV cache, a continuous-batching scheduler and (in later modules) the
model runner, kernels and HTTP server."""

__version__ = "0.1.0"
