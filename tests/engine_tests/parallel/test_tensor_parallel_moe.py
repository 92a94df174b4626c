"""Mixture-of-experts models under tensor parallelism (``model/moe``): every rank holds its share of
every expert's intermediate dimension, the router replicated, one all-reduce per MoE block.

End to end (gloo, one worker process per extra rank), through ``test_llm_equivalence.check_greedy``
with its tie-free models, prompts and tolerance: Mixtral and Qwen3-MoE at TP=2 are token-exact
against transformers' greedy path with log-probabilities within 1e-4 at every step, with prefix
caching on and off and forced preemption by recompute and by swap; TP=1 meets the same reference
in ``test_llm_equivalence``, so TP=2 is token-exact against TP=1 too. TP=4 (the heads and the
experts' intermediate sizes allow it) and a Qwen3-MoE whose second layer is dense
(``mlp_only_layers``, compared at TP=1 and TP=2) are ``slow``. Without processes: a rank reads
only its slices of each expert, and the ranks' partial outputs of a MoE block add up to the whole
block's; unsplittable configurations are refused with the architecture and the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf
from transformers import AutoConfig, AutoModelForCausalLM

from quire_engine import LLM
from quire_engine.model import moe, sharding, weights
from quire_engine.model.collectives import Collectives, Shard
from tests.engine_tests.model.test_llm_equivalence import CORE_VARIANTS, check_greedy
from tests.engine_tests.models import ARCHITECTURES, COMMON, build

MOE = ("mixtral", "qwen3-moe")
# Qwen3-MoE with layer 1 a plain MLP (``mlp_only_layers``, ``intermediate_size`` 128) after a MoE
# layer (``moe_intermediate_size`` 64); seed 4 is tie-free (min top-2 margin 3.2e-3, transformers
# 5.24).
DENSE_LAYER = "qwen3-moe-dense-layer"
# Run by default (the rest of the matrix is slow): prefix caching on, and off with preemption.
FAST = {("mixtral", "prefix-bs16"), ("qwen3-moe", "noprefix-preempt-recompute")}


def _matrix() -> list[object]:
    cases: list[object] = []
    for arch in MOE:
        for variant in CORE_VARIANTS:
            marks = () if (arch, variant) in FAST else (pytest.mark.slow,)
            cases.append(pytest.param(arch, variant, 2, marks=marks))
        cases.append(pytest.param(arch, "prefix-bs16", 4, marks=pytest.mark.slow))
    cases += [
        pytest.param(DENSE_LAYER, "noprefix-bs16", tp, marks=pytest.mark.slow) for tp in (1, 2)
    ]
    return cases


@pytest.fixture(scope="module")
def checkpoints(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    dense = build("qwen3-moe", root / DENSE_LAYER, seed=4, mlp_only_layers=[1])
    return {arch: model_dirs[arch] for arch in MOE} | {DENSE_LAYER: dense}


@pytest.mark.parametrize(("checkpoint", "variant", "tp"), _matrix())
def test_greedy_matches_transformers(
    checkpoint: str, variant: str, tp: int, checkpoints: dict[str, Path]
) -> None:
    arch = "qwen3-moe" if checkpoint == DENSE_LAYER else checkpoint
    check_greedy(str(checkpoints[checkpoint]), arch, variant, tensor_parallel_size=tp)


class _Recording:
    """A ``WeightSource`` that remembers every read (name, dim, parts) of the one it wraps."""

    def __init__(self, inner: weights.WeightSource) -> None:
        self.inner = inner
        self.reads: dict[str, tuple[int, tuple[Shard, ...]]] = {}

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def read(self, name: str, dim: int = 0, parts: tuple[Shard, ...] = ()) -> torch.Tensor:
        self.reads[name] = (dim, parts)
        return self.inner.read(name, dim, parts)


def _shard(path: Path, rank: int, world: int, source: weights.WeightSource) -> torch.nn.Module:
    """Rank ``rank``'s shard, with no group: its collectives return their input unchanged."""
    model = weights.skeleton(AutoConfig.from_pretrained(path), torch.float32)
    sharding.shard_model(model, Collectives(None, rank, world), source)
    return model


@pytest.mark.parametrize("arch", MOE)
def test_each_rank_reads_only_its_share_of_each_expert(
    arch: str, model_dirs: dict[str, Path]
) -> None:
    path = model_dirs[arch]
    cfg = AutoConfig.from_pretrained(path)
    inter, layout = moe.expert_intermediate_size(cfg), moe.LAYOUTS[cfg.model_type]
    for rank in range(2):
        source = _Recording(weights.SafetensorsSlices(path, torch.float32))
        _shard(path, rank, 2, source)
        share = (Shard(rank * inter // 2, (rank + 1) * inter // 2, inter),)
        prefix = f"model.layers.0.{layout.block}"
        for e in range(moe.num_experts(cfg)):
            at = f"{prefix}.experts.{e}"
            assert source.reads[f"{at}.{layout.gate}.weight"] == (0, share)
            assert source.reads[f"{at}.{layout.up}.weight"] == (0, share)
            assert source.reads[f"{at}.{layout.down}.weight"] == (1, share)
        assert source.reads[f"{prefix}.gate.weight"] == (0, ())  # the router, whole


@pytest.mark.parametrize("arch", MOE)
def test_rank_partial_outputs_sum_to_the_block(arch: str, model_dirs: dict[str, Path]) -> None:
    """Each rank's MoE block before its all-reduce, read from the per-expert checkpoint and from
    the fused state dict of the loaded model: same shares, and the shares sum to the whole."""
    path = model_dirs[arch]
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fused = weights.TensorSlices(dict(full.state_dict()), torch.float32)
    x = torch.randn(1, 5, int(full.config.hidden_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full.model.layers[0].mlp(x)
        parts = []
        for rank in range(2):
            from_files = _shard(path, rank, 2, weights.SafetensorsSlices(path, torch.float32))
            from_memory = _shard(path, rank, 2, fused)
            block = from_files.get_submodule("model.layers.0.mlp")
            assert isinstance(block, moe.ReducedMoE)  # its one all-reduce, none inside it
            assert not any(isinstance(m, sharding.RowParallelLinear) for m in block.modules())
            other = from_memory.get_submodule("model.layers.0.mlp.block")
            for name, param in block.block.named_parameters():
                assert torch.equal(param, other.get_parameter(name)), name
            assert (
                block.block.get_parameter("experts.down_proj").shape[-1]
                == moe.expert_intermediate_size(full.config) // 2
            )
            parts.append(block(x))  # no group: this rank's partial sum
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=0, atol=1e-5)


def test_experts_intermediate_size_that_does_not_split_is_refused(tmp_path: Path) -> None:
    path = build("mixtral", tmp_path / "mixtral", intermediate_size=66)
    with pytest.raises(
        ValueError,
        match="MixtralForCausalLM cannot run with tensor_parallel_size=4: its experts' "
        "intermediate size 66 does not split evenly over 4 ranks",
    ):
        LLM(str(path), device="cpu", num_blocks=16, tensor_parallel_size=4)
    qwen = ARCHITECTURES["qwen3-moe"]
    config = qwen[0](**(COMMON | qwen[2] | {"moe_intermediate_size": 50}))
    with pytest.raises(ValueError, match=r"Qwen3MoeConfig .* intermediate size 50 .* over 4 ranks"):
        sharding.check(config, 4)
    sharding.check(config, 2)  # 25 intermediate rows of every expert per rank


def test_moe_without_a_rule_is_refused() -> None:
    config = tf.Qwen2MoeConfig(**(COMMON | {"num_attention_heads": 4, "num_experts": 4}))
    with pytest.raises(ValueError, match=r"Qwen2MoeConfig .* experts .*'qwen2_moe'"):
        sharding.check(config, 2)
