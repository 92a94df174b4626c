"""``bench.roofline``: the step accounting behind the throughput bench's floor is exact, and the
floor is the sum of each step's larger cost (the rates are measured, so only their sign is
checked; no timing is asserted)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from quire_engine.bench import roofline
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.core.scheduler import SchedulerOutput
from quire_engine.engine.llm import LLM
from quire_engine.model.cache_shape import CacheShape
from tests.engine_tests.models import tiny_llama_config


def test_step_counts_tokens_rows_context_and_causal_pairs() -> None:
    # A 5-token prefill from position 0 and a decode at position 9, both sampling; a chunk of
    # 3 tokens from position 4 that does not sample yet.
    out = SchedulerOutput(
        block_size=16,
        num_new_tokens=[5, 1, 3],
        start_positions=[0, 9, 4],
        samples=[True, True, False],
    )
    step = roofline.Step.of(out)
    assert step.tokens == 9
    assert step.rows == 2
    assert step.context == 5 + 10 + 7
    # Query i of a chunk from position s sees s + i + 1 keys.
    assert step.pairs == (1 + 2 + 3 + 4 + 5) + 10 + (5 + 6 + 7)


def _llama() -> LlamaForCausalLM:
    cfg = tiny_llama_config(vocab_size=96, intermediate_size=48, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def test_model_cost_from_the_model_and_cache_shape() -> None:
    model = _llama()
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    cost = roofline.ModelCost.of(model, shape)
    # Per layer: q 32x32, k and v 16x32, o 32x32, gate and up 48x32, down 32x48; no biases.
    per_layer = 32 * 32 + 2 * 16 * 32 + 32 * 32 + 2 * 48 * 32 + 32 * 48
    assert cost.body_params == 2 * per_layer
    assert cost.head_params == 96 * 32
    assert cost.weight_bytes == 4 * (2 * per_layer + 96 * 32)
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # K and V, layers, KV heads, D, fp32
    assert cost.pair_flops == 4 * 2 * 4 * 8  # (q.k + p*v) x 2 FLOPs, layers, heads, D


def test_floor_is_the_sum_of_each_steps_larger_cost() -> None:
    cost = roofline.ModelCost(
        weight_bytes=1000, body_params=10, head_params=5, kv_bytes_per_token=2, pair_flops=3
    )
    rates = roofline.Rates(read_gbps=1e-6, gemm_gflops=1e-6)  # 1,000 bytes/s, 1,000 FLOP/s
    decode = roofline.Step(tokens=1, rows=1, context=50, pairs=50)
    prefill = roofline.Step(tokens=200, rows=1, context=200, pairs=20100)
    assert cost.step_bytes(decode) == 1100 and cost.step_flops(decode) == 2 * 15 + 150
    assert cost.step_bytes(prefill) == 1400
    assert cost.step_flops(prefill) == 2 * (2000 + 5) + 60300
    # The decode step is memory-bound (1.1 s vs 0.18 s), the prefill compute-bound.
    expected = 1100 / 1000 + (4010 + 60300) / 1000
    assert roofline.floor_s([decode, prefill], cost, rates) == pytest.approx(expected, rel=1e-12)


def test_step_log_records_every_step_of_an_engine_run_and_detaches() -> None:
    llm = LLM(num_blocks=64, max_model_len=128, enable_prefix_caching=False)
    log = roofline.StepLog()
    prompts = [list(range(1, 8)), list(range(1, 21))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    with log.attach(llm.engine):
        outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    # Every prompt token once, then every output token but the last is fed back once.
    assert sum(s.tokens for s in log.steps) == 7 + 20 + 2 + 4
    assert sum(s.rows for s in log.steps) == 3 + 5
    assert len(log.steps) == 5  # bounded by the longest request: one step per output token
    assert log.cost is not None and log.cost.weight_bytes > 0
    assert "execute" not in vars(llm.engine.runner)  # the runner's own method again
    machine = roofline.Rates(read_gbps=10.0, gemm_gflops=50.0)
    section = roofline.report(log, machine, tokens=8, wall_s=1.0, peers_wall_s={"peer": 3.0})
    floor = roofline.floor_s(log.steps, log.cost, machine)
    assert section["floor_s"] == pytest.approx(floor, rel=1e-3)
    assert section["max_ratio_vs_peer"] == round(3.0 / floor, 2)
    assert section["steps"] == 5


def test_report_needs_an_attached_log() -> None:
    with pytest.raises(ValueError, match="never attached"):
        roofline.report(
            roofline.StepLog(), roofline.Rates(1.0, 1.0), tokens=1, wall_s=1.0, peers_wall_s={}
        )


def test_rates_are_measured_positive() -> None:
    rates = roofline.Rates.measure((64, 32, 32), buffer_bytes=1 << 20, repeats=2)
    assert rates.read_gbps > 0 and rates.gemm_gflops > 0


def test_fastest_keeps_each_rate_at_its_best() -> None:
    slow_read = roofline.Rates(read_gbps=5.0, gemm_gflops=70.0)
    slow_gemm = roofline.Rates(read_gbps=9.0, gemm_gflops=40.0)
    assert roofline.Rates.fastest(slow_read, slow_gemm) == roofline.Rates(9.0, 70.0)
