"""transformers' own batching, the offline peers of ``bench throughput``: static batching
(``generate`` on waves of requests that fit the KV budget together, left-padded) and continuous
batching (transformers' paged ``ContinuousBatchingConfig`` held to the same budget). Each runs a
warm-up request first and returns its ``Rate``.

Ownership: this module owns the peers' timed runs; ``throughput`` owns the workload, Quire's
run and the report.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, PreTrainedModel

from quire_engine.bench.workload import RequestLengths, warm_up_prompts


@dataclass(frozen=True, slots=True)
class Rate:
    """Output tokens of one system's timed run, its wall time and its process CPU time (every
    system runs one torch thread, so CPU time is its work; unlike wall time it does not count
    time other processes of a shared machine took)."""

    tokens: int
    wall_s: float
    cpu_s: float


def hf_static(
    model: PreTrainedModel, prompts: list[list[int]], lengths: list[RequestLengths], budget: int
) -> tuple[Rate, int]:
    waves: list[list[int]] = []
    for i, r in enumerate(lengths):
        wave = waves[-1] if waves else None
        if wave is not None:
            longest = max(max(lengths[j].prompt for j in wave), r.prompt)
            new = max(max(lengths[j].output for j in wave), r.output)
            if (len(wave) + 1) * (longest + new) <= budget:
                wave.append(i)
                continue
        waves.append([i])
    _static_wave(model, warm_up_prompts(prompts, 1), 4)
    t0, c0 = time.perf_counter(), time.process_time()
    for wave in waves:
        _static_wave(model, [prompts[i] for i in wave], max(lengths[i].output for i in wave))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Rate(sum(r.output for r in lengths), elapsed, cpu), len(waves)


def _static_wave(
    model: Any,  # PreTrainedModel; its generate() is untyped for mypy
    prompts: list[list[int]],
    max_new: int,
) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(p) :] = torch.tensor(p, device=model.device)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        cfg = GenerationConfig(
            do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max_new
        )
        model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)


def hf_continuous(
    model: Any,  # PreTrainedModel with transformers' continuous-batching mixin
    prompts: list[list[int]],
    lengths: list[RequestLengths],
    budget: int,
    args: argparse.Namespace,
) -> Rate:
    gen_cfg = GenerationConfig(
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        max_new_tokens=max(r.output for r in lengths),
    )
    cb_cfg = ContinuousBatchingConfig(
        page_size=args.block_size,
        num_blocks=budget // args.block_size,
        max_batch_tokens=2048,
    )
    produced = 0
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30
    ) as manager:
        # A warm-up request, as every system gets: first-call costs out of the timed run.
        manager.add_request(warm_up_prompts(prompts, 1)[0], max_new_tokens=4, eos_token_id=-1)
        while (res := manager.get_result(timeout=5)) is None or not res.is_finished():
            if res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped in its warm-up")
        t0, c0 = time.perf_counter(), time.process_time()
        for p, r in zip(prompts, lengths, strict=True):
            manager.add_request(p, max_new_tokens=r.output, eos_token_id=-1)
        done = 0
        while done < len(prompts):
            res = manager.get_result(timeout=5)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
                continue
            if res.is_finished():
                done += 1
                produced += len(res.generated_tokens)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if produced != sum(r.output for r in lengths):
        raise RuntimeError(
            f"hf continuous produced {produced} tokens, expected {sum(r.output for r in lengths)}"
        )
    return Rate(produced, elapsed, cpu)
