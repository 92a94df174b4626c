"""A GGUF file (llama.cpp's format) as a model: found, read and dequantized through transformers.

Ownership: the one place that knows GGUF. ``find`` says whether ``--model`` names a GGUF file (a
``.gguf`` path, or a directory without ``config.json`` holding exactly one); ``read_config``,
``load_model`` and ``load_tokenizer`` read it with transformers' GGUF support (the ``gguf`` and
``accelerate`` packages of the ``engine`` extra), which maps the file's metadata to a config,
dequantizes every tensor on the CPU, and builds the tokenizer, chat template included, from the
file's vocabulary. The loader (``loader``) then treats the result as any other checkpoint: the
architecture must be one Quire serves, and the model is cast to the serving dtype and moved.

Refusals (``ValueError``): a split file (``-00001-of-00003.gguf``: transformers reads one file;
merge it with llama.cpp's ``llama-gguf-split --merge``), several ``.gguf`` files in a directory,
an architecture transformers does not map from GGUF (it cannot build a config), a file whose
tensors have other shapes than the config transformers maps from it (its mapping reads no Qwen3
head size, so a Qwen3 whose head_dim is not 128 fails), and a file that lacks tensors the mapped
model needs (a llama.cpp architecture transformers maps to a different model, such as a Mixtral
stored as ``llama`` with experts: loading it would leave those weights random).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

SUFFIX = ".gguf"
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# transformers ties the output projection to the embedding when the file has no ``output``
# tensor; the tied name is "missing" from the file but not from the model.
_TIED = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class GgufFile:
    """One ``.gguf`` file, read as ``from_pretrained(directory, gguf_file=name)``."""

    path: Path

    @property
    def directory(self) -> Path:
        return self.path.parent

    @property
    def name(self) -> str:
        return self.path.name


def find(model: str) -> GgufFile | None:
    """The GGUF file ``model`` names (the file, or a directory without ``config.json`` holding
    exactly one), or None when ``model`` is not a GGUF model (a checkpoint directory)."""
    path = Path(model).expanduser()
    if path.suffix == SUFFIX:
        if not path.is_file():
            raise ValueError(f"GGUF file {model!r} does not exist")
        return _checked(path)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{path} holds several GGUF files ({names}); name one as --model")
    return _checked(files[0]) if files else None


def _checked(path: Path) -> GgufFile:
    if _SPLIT.search(path.name):
        raise ValueError(
            f"{path.name} is one part of a split GGUF file; transformers reads a single file: "
            "merge the parts first (llama.cpp's llama-gguf-split --merge)"
        )
    return GgufFile(path)


def read_config(file: GgufFile) -> PretrainedConfig:
    """The transformers config the file's metadata maps to, with ``architectures`` set to the
    causal LM class of its model type (a GGUF file names no class)."""
    try:
        config = AutoConfig.from_pretrained(file.directory, gguf_file=file.name)
    except ImportError as exc:
        raise ValueError(
            f"reading {file.path} needs the gguf and accelerate packages: "
            f"pip install 'quire[engine]' ({exc})"
        ) from exc
    except (ValueError, KeyError) as exc:
        # transformers: "GGUF model with architecture X is not supported yet."
        raise ValueError(f"transformers cannot map the GGUF file {file.path}: {exc}") from exc
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    config.architectures = [causal] if causal else None
    return config


def load_model(file: GgufFile) -> Any:
    """The model, every tensor dequantized to float32 on the CPU (the caller casts it to the
    serving dtype): transformers keeps nothing packed (``dequantize=True``), and the quantizer it
    attaches is dropped, since the weights it describes are now plain tensors."""
    from transformers import GgufConfig

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            file.directory,
            gguf_file=file.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=file.name, dequantize=True),
            output_loading_info=True,
        )
    except RuntimeError as exc:
        # transformers refuses tensors whose shapes differ from the config it mapped (a head
        # size its GGUF mapping does not read, such as Qwen3's attention.key_length).
        raise ValueError(
            f"transformers cannot load the GGUF file {file.path} as the config it maps from "
            f"it: {str(exc).splitlines()[-1]}"
        ) from exc
    net, info = loaded  # the model and what loading found (missing_keys, ...)
    tied = bool(getattr(net.config, "tie_word_embeddings", False))
    missing = sorted(k for k in info.get("missing_keys", ()) if not (tied and k == _TIED))
    if missing:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        raise ValueError(
            f"the GGUF file {file.path} lacks {len(missing)} tensor(s) of the "
            f"{type(net).__name__} transformers maps it to ({shown}); not served"
        )
    net.hf_quantizer = None
    if hasattr(net.config, "quantization_config"):
        del net.config.quantization_config
    return net


def load_tokenizer(file: GgufFile) -> PreTrainedTokenizerBase:
    """The tokenizer and chat template stored in the file."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        file.directory, gguf_file=file.name
    )
    return tokenizer
