"""The offline API: ``LLM(...).generate(prompts, params)`` and ``LLM(...).beam_search(...)``.

Keyword arguments mirror ``quire-engine serve`` flags in snake_case. Each call queues all its
prompts and drives the engine until they finish, so they are continuously batched together.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from transformers import PreTrainedTokenizerBase

from quire_engine.core.block_pool import PoolStats
from quire_engine.core.config import EngineConfig
from quire_engine.core.lora import LoRARequest
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.llm_engine import LLMEngine

Prompt = str | list[int]
# One request of a call: prompt, sampling, beam width (None: sampling), adapter (None: base).
Work = tuple[Prompt, SamplingParams, int | None, LoRARequest | None]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """``engine_args`` are the knobs of ``EngineConfig`` by their flat names (the serve
        flags in snake_case): block_size, num_blocks, kv_cache_memory, gpu_memory_utilization,
        enable_prefix_caching, preemption_mode, swap_space, max_num_seqs,
        max_num_batched_tokens, max_model_len, device, dtype, seed, tensor_parallel_size, ...
        (docs/configuration.md). An unknown name raises ``ValueError``."""
        self.engine = LLMEngine(EngineConfig.from_flat(engine_args, model=model))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in prompt order.

        ``lora_request`` (with ``enable_lora``): one adapter for every prompt, or one per prompt
        (None: the base model); prompts of different adapters run batched together.

        A prompt is a string or a list of token ids. ``params`` is one ``SamplingParams`` for all
        or one per prompt; None takes the checkpoint's ``generation_config.json`` sampling values
        (temperature, top_p, top_k, min_p), as vLLM does. Invalid input raises ``ValueError``
        before anything is queued. A request that fails inside the engine (an internal error in
        its own sampling, say) comes back finished with ``error`` set and ``finish_reason``
        "abort"; the others are unharmed. A failure of the whole batch (the model forward)
        raises, and nothing stays queued."""
        prompt_list = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams(**self.engine.sampling_defaults)
        param_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            adapters = list(lora_request)
        if len(adapters) != len(prompt_list):
            raise ValueError(f"{len(adapters)} lora_requests for {len(prompt_list)} prompts")
        work = zip(prompt_list, param_list, adapters, strict=True)
        return self._run([(p, sp, None, lora) for p, sp, lora in work])

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        *,
        beam_width: int,
        max_tokens: int,
        ignore_eos: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Beam search per prompt; ``outputs`` holds up to ``beam_width`` beams, best first by
        cumulative log-probability. Beams share their common prefix's blocks (fork + CoW).
        ``lora_request``: every beam runs with that adapter."""
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1; got {beam_width}")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        work: list[Work] = [(p, params, beam_width, lora_request) for p in _as_prompt_list(prompts)]
        return self._run(work)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (also done when the ``LLM`` is collected
        or the interpreter exits); the ``LLM`` is unusable after."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def kv_cache_stats(self) -> PoolStats:
        """Device pool: total, used (referenced), cached-but-free and free blocks."""
        return self.engine.scheduler.kv.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's ``LLM.reset_prefix_cache``), e.g. between benchmark
        runs of the same prompts; False, and nothing forgotten, while a request holds blocks
        (never between ``generate`` calls, which finish every request they add)."""
        return self.engine.scheduler.kv.reset_prefix_cache()

    def _run(self, work: list[Work]) -> list[RequestOutput]:
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in work]
        try:
            for rid, (prompt, params, beam_width, lora) in zip(ids, work, strict=True):
                engine.add_request(rid, prompt, params, beam_width=beam_width, lora_request=lora)
            results: dict[str, RequestOutput] = {}
            pending = set(ids)
            while pending:
                outputs = engine.step()
                if not outputs and not engine.scheduler.has_unfinished():
                    raise RuntimeError("engine stalled with unfinished requests")
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
        except BaseException:
            for rid in ids:  # bad input or interruption: nothing may stay queued or held
                engine.abort_request(rid)
            raise
        return [results[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]  # a single prompt of token ids
    if not items:
        raise ValueError("prompts must not be empty")
    return items  # type: ignore[return-value]
