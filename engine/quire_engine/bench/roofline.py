"""A lower bound on an engine run's time on this machine, to read the benches' ratios against.

Every engine step must at least read the model's weights from memory once (a decode step of a
few sequences does little else), read the K/V of every context its sequences attend to, and do
the step's multiply-adds; no engine does either faster than the machine streams memory and
multiplies matrices. So:

* ``StepLog.attach(engine)`` records, for every step the engine runs (an observer of its steps,
  ``engine/observer``), what it computes, read from the scheduler's output: new tokens, sampled
  rows (LM head rows), context tokens whose K/V attention reads, and causal query-key pairs.
* ``ModelCost.of(model, ...)`` is what one token, row, context token and pair cost in bytes and
  FLOPs for that model (linear layers, LM head, K/V of every layer).
* ``Rates.measure`` times this machine's single-thread read bandwidth (``torch.sum`` over a
  buffer far larger than the caches) and fp32 GEMM rate (at a prefill-sized product of the
  model's largest linear, the faster of ``F.linear`` and the engine's own GEMM,
  ``kernels.linear_cpu.gemm``: MKL runs at half an AVX-512 core's rate on AMD CPUs), with
  torch's own kernels, best of a few runs; the benches measure before and after the engine's
  run and keep the faster (``Rates.fastest``).
* ``floor_s`` adds up, step by step, the larger of the step's memory time and its compute time at
  those rates, as if the two overlapped perfectly and nothing else (Python, dispatch, softmax,
  norms, sampling) took any time.

It is a floor for the schedule the engine ran. For the offline workload that schedule's length
is forced: one step per output token of the longest request is the least any engine needs
(without speculative decoding), and Quire runs exactly that many when the budget allows. So
``peer_wall_s / floor_s`` bounds the ratio any engine could reach over that peer on this machine.
The rates are torch's on this machine, not the silicon's peaks: a hand-tuned kernel can beat
them by a little, so read the floor as "at this machine's practical rates". On CUDA the same
accounting holds with the GPU's bandwidth and tensor-core rate (not measured here: host-side
timing of asynchronous kernels would be wrong).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from quire_engine.core.scheduler import SchedulerOutput
from quire_engine.cpu import linear as linear_cpu
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.observer import StepRecord
from quire_engine.model.cache_shape import CacheShape


@dataclass(frozen=True, slots=True)
class Step:
    """What one engine step computes (its block moves are not counted: they are rare)."""

    tokens: int  # new tokens through the model
    rows: int  # rows of logits sampled (LM head rows)
    context: int  # K/V tokens attention reads: every sequence's context after the step
    pairs: int  # causal query-key pairs: sum over sequences of sum_i (start + i + 1)

    @classmethod
    def of(cls, out: SchedulerOutput) -> Step:
        tokens = context = pairs = 0
        for start, n in zip(out.start_positions, out.num_new_tokens, strict=True):
            tokens += n
            context += start + n
            pairs += n * start + n * (n + 1) // 2  # query i sees start + i + 1 keys
        return cls(tokens, sum(out.samples), context, pairs)


class StepLog:
    """The steps of an engine run, recorded while ``attach`` lasts (one ``Step`` per step that
    ran the model; the recording costs a few microseconds per step), and the engine's model cost
    (set by ``attach``)."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.cost: ModelCost | None = None

    @contextmanager
    def attach(self, engine: LLMEngine) -> Iterator[None]:
        """Record ``engine``'s steps while the context lasts (an observer of its steps)."""
        runner = engine.runner
        self.cost = ModelCost.of(runner.model, runner.shape)
        engine.add_observer(self)
        try:
            yield
        finally:
            engine.remove_observer(self)

    def on_step(self, step: StepRecord) -> None:
        """The engine's observer call: a step that ran the model is one ``Step``."""
        if not step.schedule.is_empty:
            self.steps.append(Step.of(step.schedule))


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Bytes and FLOPs per unit of a step's work for one model."""

    weight_bytes: int  # every linear weight and bias: read once per step, whatever its size
    body_params: int  # multiply-adds per new token in the linear layers, LM head excluded
    head_params: int  # multiply-adds per sampled row in the LM head
    kv_bytes_per_token: int  # K and V of one context token, every layer
    pair_flops: int  # FLOPs per query-key pair: q.k and p*v over every head and layer

    @classmethod
    def of(cls, model: PreTrainedModel, shape: CacheShape) -> ModelCost:
        """``shape``: the runner's paged-cache shape (layers, KV heads, head size, dtype)."""
        head = model.get_output_embeddings()
        weight_bytes = body = 0
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                for p in (module.weight, module.bias):
                    if p is not None:
                        weight_bytes += p.numel() * p.element_size()
                if module is not head:
                    body += module.weight.numel()
        heads = int(model.config.num_attention_heads)
        return cls(
            weight_bytes=weight_bytes,
            body_params=body,
            head_params=head.weight.numel() if isinstance(head, torch.nn.Linear) else 0,
            kv_bytes_per_token=shape.bytes_per_token,
            pair_flops=2 * 2 * shape.num_layers * heads * shape.head_dim,
        )

    def step_bytes(self, step: Step) -> int:
        return self.weight_bytes + step.context * self.kv_bytes_per_token

    def step_flops(self, step: Step) -> int:
        linear = 2 * (self.body_params * step.tokens + self.head_params * step.rows)
        return linear + self.pair_flops * step.pairs


@dataclass(frozen=True, slots=True)
class Rates:
    """This machine's practical single-process rates, with torch's kernels."""

    read_gbps: float  # GB/s (1e9 bytes) reading memory
    gemm_gflops: float  # fp32 GFLOP/s of a large matmul

    @classmethod
    def measure(
        cls, gemm_shape: tuple[int, int, int], *, buffer_bytes: int = 256 << 20, repeats: int = 5
    ) -> Rates:
        """``gemm_shape``: (rows, out_features, in_features) of the product to time."""
        buf = torch.ones(buffer_bytes // 4)  # float32, far larger than the last-level cache
        read_s = _best_s(lambda: buf.sum(), repeats)
        m, n, k = gemm_shape
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        gemm = linear_cpu.gemm()
        gemm_s = min(
            _best_s(lambda: F.linear(x, w), repeats), _best_s(lambda: gemm(x, w, None), repeats)
        )
        return cls(buf.numel() * 4 / read_s / 1e9, 2 * m * n * k / gemm_s / 1e9)

    @classmethod
    def for_model(cls, model: torch.nn.Module, rows: int = 2048) -> Rates:
        """``measure`` with the GEMM at the model's largest linear and ``rows`` rows (a chunked
        prefill step's size, where the GEMM rate is what bounds a step)."""
        largest = max(
            (m for m in model.modules() if isinstance(m, torch.nn.Linear)),
            key=lambda m: m.weight.numel(),
        )
        out_features, in_features = largest.weight.shape
        return cls.measure((rows, out_features, in_features))

    @classmethod
    def fastest(cls, *measured: Rates) -> Rates:
        """Each rate at its best over several measurements: a shared machine's rates swing
        between minutes (±20 % here), and the floor must stay a lower bound."""
        return cls(max(r.read_gbps for r in measured), max(r.gemm_gflops for r in measured))


def _best_s(fn: Any, repeats: int) -> float:
    fn()  # warm-up (page faults, thread pools)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _step_times(steps: list[Step], cost: ModelCost, rates: Rates) -> list[tuple[float, float]]:
    """(memory seconds, compute seconds) of each step at ``rates``."""
    bandwidth, flop_rate = rates.read_gbps * 1e9, rates.gemm_gflops * 1e9
    return [(cost.step_bytes(s) / bandwidth, cost.step_flops(s) / flop_rate) for s in steps]


def floor_s(steps: list[Step], cost: ModelCost, rates: Rates) -> float:
    """Seconds the steps take at least at ``rates``: per step, the larger of its memory and
    compute times (perfect overlap), summed."""
    return sum(max(times) for times in _step_times(steps, cost, rates))


def report(
    log: StepLog, rates: Rates, *, tokens: int, wall_s: float, peers_wall_s: dict[str, float]
) -> dict[str, Any]:
    """The JSON section: the run's work, the rates, the floor, how far above it the run was
    (``vs_floor``: its wall time over the floor) and the largest ratio over each peer that any
    engine running these steps could reach here (``max_ratio_vs_<peer>``)."""
    steps, cost = log.steps, log.cost
    if cost is None:
        raise ValueError("the step log was never attached to an engine")
    times = _step_times(steps, cost, rates)
    floor = sum(max(t) for t in times)
    out: dict[str, Any] = {
        "steps": len(steps),
        "memory_bound_steps": sum(memory >= compute for memory, compute in times),
        "weight_bytes_per_step": cost.weight_bytes,
        "weight_bytes_read": cost.weight_bytes * len(steps),
        "kv_bytes_read": sum(s.context for s in steps) * cost.kv_bytes_per_token,
        "flops": sum(cost.step_flops(s) for s in steps),
        "read_gbps": round(rates.read_gbps, 2),
        "gemm_gflops": round(rates.gemm_gflops, 1),
        "floor_s": float(f"{floor:.4g}"),
        "floor_tok_s": float(f"{tokens / floor:.4g}"),
        "vs_floor": round(wall_s / floor, 2),
    }
    for peer, peer_wall in peers_wall_s.items():
        out[f"max_ratio_vs_{peer}"] = round(peer_wall / floor, 2)
    return out
