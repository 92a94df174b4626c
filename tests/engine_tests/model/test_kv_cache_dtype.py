"""``--kv-cache-dtype`` from the outside: the config, the pool it sizes, the checkpoint's fp8
scales, the signals that name it (``/v1/models``, ``/metrics``), and the serve flag and
variable."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quire_engine import LLM, SamplingParams
from quire_engine.core.config import EngineConfig, KVCacheDtype
from quire_engine.model.cache_shape import CacheShape
from quire_engine.server import cli
from tests.engine_tests.live_server import serve, tiny_settings


def test_fp8_is_vllms_alias_of_e4m3_and_bad_names_are_refused() -> None:
    assert EngineConfig.from_flat(kv_cache_dtype="fp8").cache.kv_cache_dtype is (
        KVCacheDtype.FP8_E4M3
    )
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_flat(kv_cache_dtype="int4")


@pytest.mark.parametrize(("head_dim", "vs_fp32", "vs_bf16"), [(64, 3.76, 1.88), (128, 3.88, 1.94)])
def test_8bit_tokens_cost_a_quarter_of_float32_scales_included(
    head_dim: int, vs_fp32: float, vs_bf16: float
) -> None:
    def shape(dtype: torch.dtype, kv: KVCacheDtype) -> CacheShape:
        return CacheShape(30, 3, head_dim, 16, dtype, kv)

    fp32 = shape(torch.float32, KVCacheDtype.AUTO).bytes_per_token
    bf16 = shape(torch.bfloat16, KVCacheDtype.AUTO).bytes_per_token
    for kv in (KVCacheDtype.INT8, KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2):
        eight = shape(torch.float32, kv).bytes_per_token
        assert eight == 2 * 30 * 3 * (head_dim + 4)  # a byte per element, 4 per (token, head)
        assert round(fp32 / eight, 2) == vs_fp32 and round(bf16 / eight, 2) == vs_bf16


def test_the_pool_gets_the_blocks_the_memory_buys_at_8_bits() -> None:
    blocks = {}
    for kv in ("auto", "int8"):
        with LLM(kv_cache_memory=4 << 20, kv_cache_dtype=kv, max_model_len=256) as llm:
            runner = llm.engine.runner
            blocks[kv] = llm.engine.scheduler.kv.num_blocks
            assert blocks[kv] == (4 << 20) // runner.shape.bytes_per_block
            pools = runner.device_pools
            assert sum(t.numel() * t.element_size() for t in pools) <= 4 << 20
    assert blocks["int8"] > 3.5 * blocks["auto"]  # the tiny model's head_dim is 32: x3.56


def _with_scales(src: Path, dst: Path, layers: range, value: float = 0.02) -> Path:
    """A copy of the checkpoint ``src`` whose safetensors carry llm-compressor's per-layer
    ``self_attn.k_scale`` / ``v_scale`` for ``layers``."""
    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(value)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(value / 2)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_fp8_pools_use_the_checkpoints_scales_and_int8_its_own(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    scaled = _with_scales(model_dirs["llama"], tmp_path / "scaled", range(2))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(str(scaled), kv_cache_dtype="fp8", num_blocks=32, max_model_len=64) as llm:
        assert llm.engine.runner.kv_scales == "checkpoint"
        llm.generate([[5, 6, 7, 8, 9]], params)
        k_scale, v_scale = llm.engine.runner.k_scales[0], llm.engine.runner.v_scales[0]
        written = k_scale.view(-1, k_scale.shape[-1])[:10]  # the request's 10 slots
        assert torch.equal(written, torch.full_like(written, 0.02))
        assert torch.equal(v_scale.view(-1, v_scale.shape[-1])[:10], written / 2)
    with LLM(str(scaled), kv_cache_dtype="int8", num_blocks=32, max_model_len=64) as llm:
        assert llm.engine.runner.kv_scales == "dynamic"  # calibrated scales are fp8's only


def test_a_partial_set_of_scales_falls_back_to_dynamic_and_a_bad_one_is_refused(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    partial = _with_scales(model_dirs["llama"], tmp_path / "partial", range(1))
    with LLM(str(partial), kv_cache_dtype="fp8", num_blocks=32, max_model_len=64) as llm:
        assert llm.engine.runner.kv_scales == "dynamic"
    negative = _with_scales(model_dirs["llama"], tmp_path / "negative", range(2), value=-1.0)
    with pytest.raises(ValueError, match="positive finite scale"):
        LLM(str(negative), kv_cache_dtype="fp8", num_blocks=32, max_model_len=64)


def _serve_kv_dtype(argv: list[str]) -> KVCacheDtype:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)  # reads QUIRE_* variables as the defaults
    return cli.settings_from_args(parser.parse_args(argv)).engine.cache.kv_cache_dtype


def test_serve_takes_the_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _serve_kv_dtype(["--kv-cache-dtype", "fp8_e5m2"]) is KVCacheDtype.FP8_E5M2
    monkeypatch.setenv("QUIRE_KV_CACHE_DTYPE", "int8")
    assert _serve_kv_dtype([]) is KVCacheDtype.INT8
    assert _serve_kv_dtype(["--kv-cache-dtype", "fp8"]) is KVCacheDtype.FP8_E4M3


def test_models_and_metrics_say_what_the_pool_holds() -> None:
    with serve(tiny_settings({"kv_cache_dtype": "fp8"})) as running:
        card = running.client().models.list().data[0]
        assert card.model_extra is not None and card.model_extra["kv_cache_dtype"] == "fp8_e4m3"
        samples = running.metrics()
        info = [labels for name, labels in samples if name == "vllm:cache_config_info"]
        assert ("cache_dtype", "fp8_e4m3") in info[0]
        quire = [dict(labels) for name, labels in samples if name == "quire_kv_cache_info"]
        assert quire == [
            {"cache_dtype": "fp8_e4m3", "scales": "dynamic", "bytes_per_token": str(2 * 4 * 4 * 36)}
        ]
        out = running.client().completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
        running.wait_until_idle()
