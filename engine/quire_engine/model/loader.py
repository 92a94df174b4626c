"""Turn ``model=...`` into a transformers model + tokenizer on a device.

Quire reuses transformers' modeling code (through its attention interface, see ``attention``)
rather than re-implementing each architecture: only the attention call changes, so every
architecture transformers supports for causal LM is a candidate. ``SUPPORTED_ARCHITECTURES`` lists
those whose output is tested token-exact against transformers' own ``generate``
(``tests/engine_tests/model/test_llm_equivalence.py`` checks that it is exactly its tested list).

Nothing is downloaded: ``model`` is a local checkpoint directory as the hub ships it (the
operator's init container fetches ``hf://`` models into a volume; sharded safetensors with their
index, ``generation_config.json``, the tokenizer and its chat template), a GGUF file or a
directory holding one (``gguf``: read and dequantized by transformers), or ``"tiny"``/``None``
for the embedded model. ``tokenizer_path`` replaces the model's tokenizer with a directory's.

Load-time refusals (``ValueError``, never a silent approximation): an architecture not in the
tested list; an attention call Quire cannot honour (``attention.inspect_layers``); a RoPE that
rescales itself from the batch's longest position (``dynamic``: refused; ``longrope``: served up
to ``original_max_position_embeddings``, where it is static).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
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

from quire_engine.core.sampling_params import SamplingParams
from quire_engine.kernels.kv_quant import FixedScales
from quire_engine.model import attention, gguf, sharding, tiny_model, weights
from quire_engine.model.collectives import Collectives
from quire_engine.model.kv_scales import read_kv_scales

logger = logging.getLogger(__name__)

TINY = "tiny"
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# generation_config.json fields that become default sampling values (as vLLM's
# `--generation-config auto` does), mapped to SamplingParams names.
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A loaded checkpoint and what the engine needs to know about it.

    ``max_position_embeddings`` is the longest context served token-exact (the model's own
    limit, or less where ``context_limit`` says why). ``layers`` is every layer's attention as
    the model asks for it. ``eos_token_ids`` are the tokens that end a generation: the
    tokenizer's EOS and every ``eos_token_id`` of ``generation_config.json``.
    ``sampling_defaults`` are the checkpoint's default sampling values (only those it sets).
    ``kv_scales``: the checkpoint's per-layer KV cache scales (``kv_scales``), for fp8 pools.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    max_position_embeddings: int
    layers: tuple[attention.LayerAttention, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    context_limit: str = "the model's max_position_embeddings"  # what sets the limit, and why
    num_kv_heads: int | None = None  # this rank's KV heads under tensor parallelism
    kv_scales: tuple[FixedScales, ...] | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window every layer obeys (positions older than it are read by no layer), or
        None when any layer attends to the whole context."""
        windows = [layer.sliding_window for layer in self.layers]
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)


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


def load(
    model: str | None,
    device: torch.device,
    dtype: torch.dtype,
    chat_template: str | None = None,
    comm: Collectives | None = None,
    tokenizer_path: str | None = None,
) -> LoadedModel:
    """Load ``model`` onto ``device`` as ``dtype``. ``chat_template`` (a Jinja template, or the
    path of a file holding one) replaces the tokenizer's own; ``tokenizer_path`` (a directory)
    the model's tokenizer. ``comm``: this rank's tensor-parallel group; the model is then this
    rank's shard (``sharding``), read as slices of the checkpoint's safetensors files (of the
    dequantized model, for a GGUF file)."""
    started = time.monotonic()
    world = comm.world if comm is not None else 1
    if model is None or model == TINY:
        # Always seed 0: "tiny" names one fixed model, whatever the engine's sampling seed.
        net: Any = tiny_model.build_tiny_model(seed=0)
        if comm is not None and world > 1:
            full = weights.TensorSlices(dict(net.state_dict()), dtype)
            sharding.shard_model(net, comm, full)
        net = torch.nn.Module.to(net, device, dtype)
        tokenizer: PreTrainedTokenizerBase = (
            tiny_model.build_tokenizer()
            if tokenizer_path is None
            else _load_tokenizer(tokenizer_path, Path(TINY), None)
        )
        name, limit, generation = TINY, int(net.config.max_position_embeddings), {}
        reason = f"the model's max_position_embeddings={limit}"
        kv_scales = None
    else:
        gguf_file = gguf.find(model)
        if gguf_file is not None:
            path = gguf_file.path
            config = gguf.read_config(gguf_file)
        else:
            path = Path(model).expanduser()
            _check_checkpoint(path, model)
            config = AutoConfig.from_pretrained(path)
        archs = list(getattr(config, "architectures", None) or [])
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs[0] if archs else None!r} in {path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if world > 1:
            sharding.check(config, world)  # before reading anything
        limit, reason = _context_limit(config)
        tokenizer = _load_tokenizer(tokenizer_path, path, gguf_file)
        # A GGUF file carries no generation_config.json; one beside it counts.
        generation = _generation_config(path.parent if gguf_file is not None else path)
        logger.info("loading %s (%s) onto %s as %s", path, archs[0], device, dtype)
        if gguf_file is not None:
            # Dequantized on the CPU in float32, then cast: the serving dtype rounds the
            # GGUF's values once. Under tensor parallelism each rank keeps its slices.
            net = gguf.load_model(gguf_file)
            if comm is not None and world > 1:
                sharding.shard_model(net, comm, weights.TensorSlices(dict(net.state_dict()), dtype))
            net = torch.nn.Module.to(net, device, dtype)
        # Safetensors are read tensor by tensor straight onto the device (``weights``); other
        # checkpoints through transformers, which loads on the CPU (with a progress bar on
        # stderr) before the model moves.
        elif comm is not None and world > 1:
            net = weights.skeleton(config, dtype)
            sharding.shard_model(net, comm, weights.SafetensorsSlices(path, dtype, device))
        else:
            net = weights.load_whole(path, config, dtype, device)
            if net is None:
                net = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        net = torch.nn.Module.to(net, device).eval()
        name = str(path)
        layer_count = int(config.num_hidden_layers)
        kv_scales = None if gguf_file is not None else read_kv_scales(path, layer_count)
    if chat_template is not None:
        tokenizer.chat_template = _read_template(chat_template)
    cfg = net.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    local_kv = sharding.local_kv_heads(cfg, world) if world > 1 else None
    layers = tuple(attention.inspect_layers(net, local_kv or kv_heads, head_dim))
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos |= _ids(generation.get("eos_token_id"))
    defaults = {k: generation[k] for k in _SAMPLING_DEFAULTS if generation.get(k) is not None}
    if defaults.get("top_k") in (0, -1):  # transformers' and vLLM's spellings of "no limit"
        del defaults["top_k"]
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"generation_config.json of {name}: {exc}") from exc
    loaded = LoadedModel(
        net, tokenizer, name, limit, layers, tuple(sorted(eos)), defaults, reason, local_kv,
        kv_scales,
    )  # fmt: skip
    logger.info(
        "model %s ready in %.1f s: %d layers (%s), EOS ids %s, sampling defaults %s",
        name,
        time.monotonic() - started,
        len(layers),
        _describe(layers),
        list(loaded.eos_token_ids),
        defaults or "none",
    )
    return loaded


def check_tensor_parallel(model: str | None, world: int) -> None:
    """``ValueError`` when ``model`` cannot be sharded over ``world`` ranks (``sharding.check``),
    read from its config alone: what the engine checks before starting any worker."""
    if model is None or model == TINY:
        sharding.check(tiny_model.tiny_config(), world)
        return
    gguf_file = gguf.find(model)
    if gguf_file is not None:
        sharding.check(gguf.read_config(gguf_file), world)
        return
    path = Path(model).expanduser()
    _check_checkpoint(path, model)
    sharding.check(AutoConfig.from_pretrained(path), world)


def _load_tokenizer(
    tokenizer_path: str | None, model: Path, gguf_file: gguf.GgufFile | None
) -> PreTrainedTokenizerBase:
    """``tokenizer_path``'s tokenizer (a local directory) when given, else the model's own: the
    checkpoint directory's, or the one stored in the GGUF file."""
    where = model if tokenizer_path is None else Path(tokenizer_path).expanduser()
    if tokenizer_path is not None and not where.is_dir():
        raise ValueError(f"tokenizer {tokenizer_path!r} is not a local directory")
    try:
        if tokenizer_path is None and gguf_file is not None:
            return gguf.load_tokenizer(gguf_file)
        loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot load the tokenizer from {where}: {exc}") from exc
    return loaded


def _check_checkpoint(path: Path, model: str) -> None:
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is not a local directory (Quire loads local checkpoints and "
            f"GGUF files; use model='tiny' for the embedded model)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json (and no .gguf file)")
    for index in path.glob("*.index.json"):
        # A sharded checkpoint: every shard its index names must be there.
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a weight index (no weight_map): {exc}") from exc
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ValueError(f"{index.name} names shards missing from {path}: {missing}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(f"model directory {path} has no weights (*.safetensors or *.bin)")


def _context_limit(config: Any) -> tuple[int, str]:
    """The longest context served exactly, and what sets it."""
    limit = int(config.max_position_embeddings)
    reason = f"the model's max_position_embeddings={limit}"
    params = getattr(config, "rope_parameters", None) or {}
    # Per layer type (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}) or flat.
    groups = [p for p in params.values() if isinstance(p, dict)] or [params]
    for rope in groups:
        kind = rope.get("rope_type", "default")
        if "dynamic" in kind:
            raise ValueError(
                f"rope_type {kind!r} rescales RoPE from the longest position of each forward "
                "pass; Quire batches sequences of different lengths into one pass, so it would "
                "not match transformers. Not supported"
            )
        if kind == "longrope":
            # longrope picks its short or long factors from the batch's longest position:
            # below original_max_position_embeddings it always takes the short ones.
            original = int(
                rope.get("original_max_position_embeddings")
                or config.original_max_position_embeddings
            )
            if original < limit:
                limit = original
                reason = (
                    f"original_max_position_embeddings={original} (longrope switches factors "
                    "on the longest position of a batch; below this it is static)"
                )
    return limit, reason


def _generation_config(path: Path) -> dict[str, Any]:
    """The fields ``generation_config.json`` sets (not transformers' defaults for the others:
    an unset ``top_k`` must not become 50)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        fields = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {file}: {exc}") from exc
    if not isinstance(fields, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return fields


def _ids(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}  # type: ignore[attr-defined]


def _read_template(template: str) -> str:
    """A template given inline, or the path of a file holding one."""
    candidate = Path(template).expanduser()
    if "{" not in template and len(template) < 4096:
        if not candidate.is_file():
            raise ValueError(f"chat template file {template!r} does not exist")
        return candidate.read_text()
    return template


def _describe(layers: tuple[attention.LayerAttention, ...]) -> str:
    windows = sorted({layer.sliding_window for layer in layers if layer.sliding_window})
    caps = sorted({layer.softcap for layer in layers if layer.softcap})
    parts = [f"sliding window {windows} on {sum(bool(x.sliding_window) for x in layers)}"]
    if not windows:
        parts = ["full attention"]
    if caps:
        parts.append(f"soft-cap {caps}")
    return ", ".join(parts)
