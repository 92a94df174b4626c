"""Turn ``model=...`` into a transformers model + tokenizer on a device.

Quire reuses transformers' modeling code (through its attention interface, see ``attention``)
rather than re-implementing each architecture: only the attention call changes, so every
architecture transformers supports for causal LM is a candidate. ``SUPPORTED_ARCHITECTURES`` lists
those whose output is tested token-exact against transformers' own ``generate``.

Nothing is downloaded: ``model`` is a local checkpoint directory (the operator's init container
fetches ``hf://`` models into a volume) or ``"tiny"``/``None`` for the embedded model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from quire_engine import tiny_model

logger = logging.getLogger(__name__)

TINY = "tiny"
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    max_position_embeddings: int
    sliding_window: int | None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda (optionally cuda:N); got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # float32 on CPU (exactness, and CPUs gain little from half precision); bf16 on GPUs.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def load(model: str | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if model is None or model == TINY:
        # Always seed 0: "tiny" names one fixed model, whatever the engine's sampling seed.
        net: Any = torch.nn.Module.to(tiny_model.build_tiny_model(seed=0), device, dtype)
        config = net.config
        return LoadedModel(
            net, tiny_model.build_tokenizer(), TINY, config.max_position_embeddings, None
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is not a local directory (Quire loads local checkpoints; "
            f"use model='tiny' for the embedded model)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(f"model directory {path} has no weights (*.safetensors or *.bin)")
    config = AutoConfig.from_pretrained(path)
    archs = list(getattr(config, "architectures", None) or [])
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0] if archs else None!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot load the tokenizer from {path}: {exc}") from exc
    logger.info("loading %s (%s) onto %s as %s", path, archs[0], device, dtype)
    kwargs: dict[str, Any] = {"dtype": dtype}
    net = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    net = torch.nn.Module.to(net, device).eval()
    return LoadedModel(
        net, tokenizer, str(path), int(config.max_position_embeddings), _sliding_window(config)
    )


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)
