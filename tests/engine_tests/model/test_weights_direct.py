"""Safetensors read tensor by tensor straight to the device (``weights.load_whole``) give exactly
the model transformers' ``from_pretrained`` gives: every architecture, float32 and bfloat16, a
tied LM head, a sharded checkpoint; the same parameters and buffers, names, dtypes and bits. What
is not that simple (a ``.bin`` checkpoint, a tensor under another name) is left to transformers,
and the engine still loads it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from quire_engine.model import loader, weights
from tests.engine_tests.models import ARCHITECTURES, build

CPU = torch.device("cpu")


def assert_same_model(got: PreTrainedModel, want: PreTrainedModel) -> None:
    got_state, want_state = got.state_dict(), want.state_dict()
    assert list(got_state) == list(want_state)
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert got_state[name].device == tensor.device, name
        assert torch.equal(got_state[name], tensor), name
    assert [n for n, _ in got.named_parameters()] == [n for n, _ in want.named_parameters()]
    if getattr(want.config, "tie_word_embeddings", False):
        assert got.get_output_embeddings().weight is got.get_input_embeddings().weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_direct_load_is_exactly_from_pretrained(
    arch: str, dtype: torch.dtype, model_dirs: dict[str, Path]
) -> None:
    path = model_dirs[arch]
    want = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    got = weights.load_whole(path, AutoConfig.from_pretrained(path), dtype, CPU)
    if got is None:
        # Only a checkpoint whose tensors transformers converts while loading goes its way.
        names = set(load_file(str(path / "model.safetensors")))
        assert not {n for n, _ in want.named_parameters()} <= names, arch
        return
    assert_same_model(got, want)


def test_a_tied_head_is_read_once_and_tied(tmp_path: Path) -> None:
    path = build("llama", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    got = weights.load_whole(path, AutoConfig.from_pretrained(path), torch.float32, CPU)
    assert got is not None
    assert_same_model(got, want)


def test_a_sharded_checkpoint_is_read_through_its_index(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="150KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    got = weights.load_whole(tmp_path, model.config, torch.float32, CPU)
    assert got is not None
    assert_same_model(got, model)


def test_what_is_not_plain_safetensors_is_left_to_transformers(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    # A tensor under a name the model does not use: transformers' business (it may rename).
    renamed = tmp_path / "renamed"
    shutil.copytree(model_dirs["llama"], renamed)
    file = renamed / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(renamed)
    assert weights.load_whole(renamed, config, torch.float32, CPU) is None
    # A .bin checkpoint: no safetensors at all; the engine still loads it through transformers.
    pickled = tmp_path / "pickled"
    shutil.copytree(model_dirs["llama"], pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    assert weights.load_whole(pickled, model.config, torch.float32, CPU) is None
    loaded = loader.load(str(pickled), CPU, torch.float32)
    assert_same_model(loaded.model, model.eval())
