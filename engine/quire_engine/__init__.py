"""Quire's LLM engine: a paged KV cache, a continuous-batching scheduler, a model runner with a
Triton paged-attention kernel, and an OpenAI-compatible server.

``from quire_engine import LLM, SamplingParams`` loads torch lazily: the pure-Python core
(``quire_engine.core``: block pool, scheduler, request table) and the allocator benchmark never
import it. The layer folders and the rules between them: docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quire_engine.core.threads import set_up_waits

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]

# First, before any module here imports torch: libgomp reads its wait policy once, when torch
# loads it, and spinning waits make extra threads slower than one on shared cores
# (core.threads). The engine logs what this found at start.
set_up_waits()

if TYPE_CHECKING:
    from quire_engine.core.sampling_params import SamplingParams
    from quire_engine.engine.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from quire_engine.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from quire_engine.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
