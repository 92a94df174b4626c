"""The engine's build: an ``EngineConfig`` into the parts the engine runs on, once.

``build`` resolves the device and dtype, starts the tensor-parallel ``WorkerGroup`` (the other
ranks start first: loading and sizing the pool are collective), loads the model, plans the KV
cache, and builds the ``Scheduler``, the ``ModelRunner``, the ``RequestTable``, the
``GrammarCache`` and the engine's RNG, recording the start-up phases on the way. It returns them
as one ``EngineParts``; ``LLMEngine`` owns them from then on (and stops the workers with itself).
If the build fails after starting workers, it stops them before raising.

Configuration: what the build itself reads of the config is read in one place,
``BuildSettings.of``; the cache plan and the worker group read their own fields of the config
they are given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quire_engine.core.config import (
    CacheConfig,
    EngineConfig,
    PreemptionMode,
    SchedulerConfig,
)
from quire_engine.core.request_table import RequestTable
from quire_engine.core.scheduler import Scheduler
from quire_engine.engine.startup import StartupPhase, StartupTimes
from quire_engine.model import loader as model_loader
from quire_engine.model.cache_plan import plan_cache
from quire_engine.model.runner import ModelRunner
from quire_engine.parallel.group import WorkerGroup
from quire_engine.structured.grammars import GrammarCache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def check_placement(device: str, dtype: str) -> None:
    """Raise ``ValueError`` for a ``--device`` / ``--dtype`` pair this machine cannot serve; what
    the engine checks first, before loading anything (the server checks it before listening)."""
    model_loader.resolve_dtype(dtype, model_loader.resolve_device(device))


@dataclass(frozen=True, slots=True)
class BuildSettings:
    """The fields of the engine's configuration that the build reads itself."""

    model: str | None
    device: str
    dtype: str
    chat_template: str | None
    tensor_parallel_size: int
    max_num_seqs: int
    preemption_mode: PreemptionMode
    block_size: int
    enable_prefix_caching: bool
    seed: int

    @classmethod
    def of(cls, config: EngineConfig) -> BuildSettings:
        """The one reader of ``config`` here (where a reshaped configuration is adapted)."""
        return cls(
            model=config.model,
            device=config.device,
            dtype=config.dtype,
            chat_template=config.chat_template,
            tensor_parallel_size=config.tensor_parallel_size,
            max_num_seqs=config.max_num_seqs,
            preemption_mode=config.preemption_mode,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            seed=config.seed,
        )


@dataclass(frozen=True, slots=True)
class EngineParts:
    """What the build hands the engine; each part keeps its own state."""

    device: torch.device
    dtype: torch.dtype
    parallel: WorkerGroup | None  # tensor parallelism: the other ranks (this process is rank 0)
    model_name: str
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]  # the tokenizer's EOS and generation_config.json's list
    sampling_defaults: dict[str, Any]  # the checkpoint's default sampling values
    vocab_size: int
    max_model_len: int
    scheduler: Scheduler
    runner: ModelRunner
    requests: RequestTable
    grammars: GrammarCache  # compiled grammars, shared with the server's compile thread
    rng: torch.Generator  # seeds the samples of unseeded requests


def build(config: EngineConfig, startup: StartupTimes) -> EngineParts:
    """Every part of an engine for ``config``; ``startup`` records the phases."""
    settings = BuildSettings.of(config)
    device = model_loader.resolve_device(settings.device)
    dtype = model_loader.resolve_dtype(settings.dtype, device)
    parallel = WorkerGroup(config) if settings.tensor_parallel_size > 1 else None
    try:
        return _load(config, settings, startup, device, dtype, parallel)
    except BaseException:
        if parallel is not None:
            parallel.close()
        raise


def _load(
    config: EngineConfig,
    settings: BuildSettings,
    startup: StartupTimes,
    device: torch.device,
    dtype: torch.dtype,
    parallel: WorkerGroup | None,
) -> EngineParts:
    comm = parallel.comm if parallel is not None else None
    phase = startup.phase
    # A wait for a shared model cache goes here, inside phase(StartupPhase.MODEL_CACHE).
    with phase(StartupPhase.WEIGHTS):
        loaded = model_loader.load(settings.model, device, dtype, settings.chat_template, comm)
    vocab_size = int(getattr(loaded.model.config, "vocab_size"))  # noqa: B009
    with phase(StartupPhase.KV_PROFILE):
        cache = plan_cache(config, loaded, device, dtype, comm)
    max_len, shape = cache.max_model_len, cache.shape
    num_blocks, num_cpu_blocks = cache.num_blocks, cache.num_cpu_blocks
    scheduler = Scheduler(
        SchedulerConfig(
            settings.max_num_seqs, cache.max_num_batched_tokens, max_len, settings.preemption_mode
        ),
        CacheConfig(
            num_blocks,
            settings.block_size,
            settings.enable_prefix_caching,
            num_cpu_blocks,
            sliding_window=loaded.sliding_window,
        ),
    )
    with phase(StartupPhase.KV_ALLOCATE):
        runner = ModelRunner(
            loaded.model,
            shape,
            num_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            device=device,
            layers=loaded.layers,
            native_linears=comm is None,
        )
    if parallel is not None:
        runner.publish = parallel.publish
    logger.info(
        "KV pool: %d blocks x %d tokens (%.1f MiB per rank), %d CPU swap blocks, "
        "max_model_len %d, tensor_parallel_size %d",
        num_blocks,
        settings.block_size,
        num_blocks * shape.bytes_per_block / 2**20,
        num_cpu_blocks,
        max_len,
        settings.tensor_parallel_size,
    )
    eos = frozenset(loaded.eos_token_ids)
    return EngineParts(
        device=device,
        dtype=dtype,
        parallel=parallel,
        model_name=loaded.name,
        tokenizer=loaded.tokenizer,
        eos_token_ids=eos,
        sampling_defaults=loaded.sampling_defaults,
        vocab_size=vocab_size,
        max_model_len=max_len,
        scheduler=scheduler,
        runner=runner,
        requests=RequestTable(scheduler, loaded.tokenizer),
        grammars=GrammarCache(loaded.tokenizer, vocab_size, eos),
        rng=torch.Generator().manual_seed(settings.seed),
    )
