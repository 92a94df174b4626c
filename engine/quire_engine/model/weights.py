"""Where a model's weights come from: slices of the checkpoint's safetensors files, or of a model
already in memory (the embedded tiny one), and the weightless model they fill.

Both sources implement ``WeightSource``, all that ``sharding`` and ``moe`` read through.

``SafetensorsSlices`` opens each shard file once (``safe_open``, memory-mapped) and reads only the
requested rows or columns of a tensor (``get_slice``), so a tensor-parallel rank never reads
another rank's share; each tensor goes to the target device and dtype in one step, one tensor at
a time, so loading never holds a second copy of the model (on CPU, a tensor already in the
target dtype stays a view of the mapped file). ``skeleton`` builds the transformers model with
every parameter on the meta device (no memory, no initialisation) but real buffers (rotary
tables, Gemma's embedding scale), for ``sharding`` or ``fill`` to fill; ``load_whole`` is the two
together for one device, where the checkpoint's tensors are the model's parameters as they are.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from quire_engine.model.collectives import Shard

logger = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Reads one named tensor of the checkpoint, or only some slices of one dimension of it."""

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor ``name``."""
        ...

    def read(self, name: str, dim: int = 0, parts: tuple[Shard, ...] = ()) -> torch.Tensor:
        """The slices ``parts`` of dimension ``dim`` concatenated (``parts`` empty: all of it)."""
        ...


class SafetensorsSlices:
    """Tensors by name from the ``*.safetensors`` files of ``path`` (through its weight index
    when sharded), as ``dtype`` on ``device``."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device | None = None) -> None:
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self._files: dict[str, Any] = {}
        self._where: dict[str, Path] = {}
        indexes = list(path.glob("*.safetensors.index.json"))
        if indexes:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
            self._where = {name: path / file for name, file in weight_map.items()}
        else:
            for file in sorted(path.glob("*.safetensors")):
                with safe_open(str(file), "pt") as handle:
                    self._where.update(dict.fromkeys(handle.keys(), file))
        if not self._where:
            raise ValueError(
                f"tensor parallelism reads safetensors checkpoints; {path} has no *.safetensors"
            )

    def _slice(self, name: str) -> Any:
        file = self._where.get(name)
        if file is None:
            raise ValueError(f"the checkpoint has no tensor {name!r}")
        handle = self._files.get(str(file))
        if handle is None:
            handle = self._files[str(file)] = safe_open(str(file), "pt")
        return handle.get_slice(name)

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape, read from the file's header; None when there is no such tensor."""
        if name not in self._where:
            return None
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int = 0, parts: tuple[Shard, ...] = ()) -> torch.Tensor:
        view = self._slice(name)
        # [:] and ranges of the first dimension are views of the mapped file; only the pieces of
        # a split along a later dimension, and the concatenation of several pieces, are copied
        # before the move.
        if not parts:
            whole = view[:]
        else:
            lead = (slice(None),) * dim  # the dimensions before ``dim``, read whole
            pieces = [view[(*lead, slice(a, b))] for a, b, _ in parts]
            whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
        return whole.to(device=self.device, dtype=self.dtype)


class TensorSlices:
    """The same reads over a state dict in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors = tensors
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, dim: int = 0, parts: tuple[Shard, ...] = ()) -> torch.Tensor:
        full = self.tensors[name]
        if not parts:
            return full.detach().to(self.dtype, copy=True)
        pieces = [full.narrow(dim, a, b - a) for a, b, _ in parts]
        return torch.cat(pieces, dim=dim).to(self.dtype)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every ``nn.Parameter`` registered meanwhile lives on the meta device; buffers do not."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            meta = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def skeleton(config: Any, dtype: torch.dtype) -> PreTrainedModel:
    """The model of ``config`` with meta parameters and real buffers, in eval mode."""
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def fill(model: torch.nn.Module, source: WeightSource) -> None:
    """Read every parameter of ``model`` still on the meta device whole from ``source`` (a
    ``WeightSource``), in the parameter's own dtype."""
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            path, _, leaf = name.rpartition(".")
            tensor = source.read(name)
            if tensor.dtype != param.dtype:  # a module transformers keeps in float32
                tensor = tensor.to(param.dtype)
            value = torch.nn.Parameter(tensor, requires_grad=False)
            setattr(model.get_submodule(path), leaf, value)


def load_whole(
    path: Path, config: Any, dtype: torch.dtype, device: torch.device
) -> PreTrainedModel | None:
    """The model of ``path`` on ``device`` as ``dtype``, read tensor by tensor from its
    safetensors files straight to the device; None when the checkpoint is not that simple: no
    safetensors, or a parameter whose name or shape the files do not hold as such (a checkpoint
    that transformers converts while loading, as it fuses mixture-of-experts weights)."""
    if not any(path.glob("*.safetensors")):
        return None
    source = SafetensorsSlices(path, dtype, device)
    model = skeleton(config, dtype)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head_module = model.get_output_embeddings() if tied else None
    head = next((f"{n}.weight" for n, m in model.named_modules() if m is head_module), None)
    for name, param in model.named_parameters():
        if name != head and source.shape(name) != tuple(param.shape):
            logger.info(
                "%s: %s is not in its safetensors as such; transformers loads it", path, name
            )
            return None
    if head is not None:  # the checkpoint stores a tied LM head once, as the embedding
        head_path, _, leaf = head.rpartition(".")
        delattr(model.get_submodule(head_path), leaf)
    fill(model, source)
    if tied:  # one parameter for both, as transformers ties them
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model
