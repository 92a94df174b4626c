"""Where an engine's step time goes: ``--profile`` of the benches.

``StepProfile.attach(engine)`` times, for as long as the context lasts and in thread CPU time, the
whole step (an observer the engine calls after each step, ``engine/observer``), the model's
forward and every ``nn.Linear`` of the model (the matmuls, LM head included; torch forward
hooks), the paged attention call (K/V write + attention; a timed function registered under the
engine's attention name) and the runner's native decode steps (the runner's
``forward_observer`` hook). No engine or runner method is replaced. The split it reports, in
seconds and as shares of the step time:

* ``matmuls``: inside ``nn.Linear`` forwards;
* ``attention``: inside the paged attention call (writing K/V, gathering blocks, SDPA or kernel);
* ``forward_other``: the rest of the forward (embeddings, RMSNorm, RoPE, activations, module
  calls);
* ``native_decoder``: the steps whose whole forward ran as one native call
  (``cpu/decoder``: matmuls, attention and the rest together, not split further);
* ``step_python``: the step outside the forward (schedule, inputs, sampling, detokenization,
  outputs).

The hooks cost a few microseconds per module call, so a profiled run is slower than a plain one:
compare shares, and time throughput without ``--profile``. On CUDA the times are host times of
asynchronous launches, not GPU time.

``quire-engine serve --profile`` installs a profile on the server's engine for the process's
life and exports it on ``/metrics`` (``ProfileCollector``) as
``quire_profile_step_cpu_seconds_total{phase=...}`` and ``quire_profile_steps_total``;
``bench serve --profile`` reads them before and after its run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from prometheus_client.core import CounterMetricFamily, Metric
from transformers import AttentionInterface

from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.observer import StepRecord
from quire_engine.model import attention


def timed(totals: dict[str, int], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` adding its thread CPU nanoseconds to ``totals[name]`` at every call."""
    clock = time.thread_time_ns

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0) + clock() - t0

    return wrapper


class StepProfile:
    def __init__(self) -> None:
        self.ns: dict[str, int] = {
            "step": 0, "forward": 0, "matmuls": 0, "attention": 0, "native_decoder": 0,
        }  # fmt: skip
        self.steps = 0
        self._installed: ExitStack | None = None

    @contextmanager
    def attach(self, engine: LLMEngine) -> Iterator[None]:
        """Profile ``engine``'s steps while the context lasts: an observer of its steps and of
        its runner's native decode steps, torch forward hooks on the model and its linears,
        and a timed attention function in transformers' registry; all removed at exit."""
        runner = engine.runner
        model = runner.model
        handles = []
        starts: list[int] = []

        def pre(*_: Any) -> None:
            starts.append(time.thread_time_ns())

        def post_for(name: str) -> Callable[..., None]:
            def post(*_: Any) -> None:
                self.ns[name] += time.thread_time_ns() - starts.pop()

            return post

        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post_for("matmuls")))
        handles.append(model.register_forward_pre_hook(pre))
        handles.append(model.register_forward_hook(post_for("forward")))
        engine.add_observer(self)
        runner.forward_observer = self
        # Models look their attention function up by name at every call.
        AttentionInterface.register(
            attention.ATTENTION_NAME, timed(self.ns, "attention", attention.paged_attention_forward)
        )
        try:
            yield
        finally:
            engine.remove_observer(self)
            if runner.forward_observer is self:
                runner.forward_observer = None
            attention.register()
            for handle in handles:
                handle.remove()

    def on_step(self, step: StepRecord) -> None:
        """The engine's observer call after each step: its whole thread CPU time."""
        self.steps += 1
        self.ns["step"] += step.cpu_ns

    def on_native_decode(self, cpu_ns: int) -> None:
        """The runner's hook: a step whose forward ran as one native call (the other steps'
        check for it is step Python)."""
        self.ns["native_decoder"] += cpu_ns

    def install(self, engine: LLMEngine) -> LLMEngine:
        """``attach`` for the rest of the process's life (``serve --profile``); returns the
        engine, so that it can wrap an engine factory."""
        self._installed = ExitStack()
        self._installed.enter_context(self.attach(engine))
        return engine

    def parts_ns(self) -> dict[str, int]:
        """Thread CPU nanoseconds per phase so far (the phases partition the step time)."""
        ns = dict(self.ns)  # one snapshot: another thread may be stepping
        return {
            "matmuls": ns["matmuls"],
            "attention": ns["attention"],
            "forward_other": ns["forward"] - ns["matmuls"] - ns["attention"],
            "native_decoder": ns["native_decoder"],
            "step_python": ns["step"] - ns["forward"] - ns["native_decoder"],
        }

    def report(self) -> dict[str, Any]:
        return split_report(self.steps, {k: v / 1e9 for k, v in self.parts_ns().items()})


def split_report(steps: int, parts_s: dict[str, float]) -> dict[str, Any]:
    """The profile's JSON: steps, step CPU seconds, and the split in seconds and shares.
    Seconds keep microseconds: a small model's phase can total well under a millisecond."""
    total = sum(parts_s.values())
    return {
        "steps": steps,
        "step_cpu_s": round(total, 6),
        "split_s": {k: round(v, 6) for k, v in parts_s.items()},
        "split_share": {k: round(v / total, 3) if total > 0 else 0.0 for k, v in parts_s.items()},
    }


class ProfileCollector:
    """A live ``StepProfile`` as Prometheus counters, read at scrape time (``serve --profile``)."""

    def __init__(self, profile: StepProfile, model_name: str) -> None:
        self.profile = profile
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        cpu = CounterMetricFamily(
            "quire_profile_step_cpu_seconds",
            "Engine-thread CPU seconds inside engine steps, by phase (serve --profile only).",
            labels=["model_name", "phase"],
        )
        for phase, ns in self.profile.parts_ns().items():
            cpu.add_metric([self.model_name, phase], ns / 1e9)
        steps = CounterMetricFamily(
            "quire_profile_steps", "Engine steps profiled.", labels=["model_name"]
        )
        steps.add_metric([self.model_name], self.profile.steps)
        return [cpu, steps]
