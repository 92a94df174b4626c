"""The engine's build: an ``EngineConfig`` into the parts the engine runs on, once.

``build`` resolves the device and dtype, starts the tensor-parallel ``WorkerGroup`` (the other
ranks start first: loading and sizing the pool are collective), loads the model, plans the KV
cache, and builds the ``Scheduler``, the ``ModelRunner``, the ``RequestTable``, the
``GrammarCache`` and the engine's RNG, recording the start-up phases on the way. It returns them
as one ``EngineParts``; ``LLMEngine`` owns them from then on (and stops the workers with itself).
If the build fails after starting workers, it stops them before raising.

Configuration: each part takes its sub-config as declared (``core.config``): the loader
``config.model``, the worker group ``config.parallel``; the cache plan resolves what start-up
derives (the pool's blocks, ``max_model_len``, the token budget) into ``config.scheduler`` and
``config.cache`` once, and the scheduler takes those resolved sub-configs unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quire_engine.core.config import EngineConfig
from quire_engine.core.request_table import RequestTable
from quire_engine.core.scheduler import Scheduler
from quire_engine.core.threads import openmp_waits, resolve_threads
from quire_engine.cpu import bf16 as bf16_cpu
from quire_engine.engine.startup import StartupPhase, StartupTimes
from quire_engine.model import loader as model_loader
from quire_engine.model.cache_plan import plan_cache
from quire_engine.model.lora import LoRAModel
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
    device = model_loader.resolve_device(config.model.device)
    dtype = model_loader.resolve_dtype(config.model.dtype, device)
    bf16_cpu.log_support(device, dtype)
    # Before the worker group, which splits the count over this node's ranks on CPU.
    plan = resolve_threads(config.parallel.threads)
    torch.set_num_threads(plan.threads)
    logger.info("%s", plan.describe(openmp_waits()))
    parallel = WorkerGroup(config) if config.parallel.tensor_parallel_size > 1 else None
    try:
        return _load(config, startup, device, dtype, parallel)
    except BaseException:
        if parallel is not None:
            parallel.close()
        raise


def _load(
    config: EngineConfig,
    startup: StartupTimes,
    device: torch.device,
    dtype: torch.dtype,
    parallel: WorkerGroup | None,
) -> EngineParts:
    comm = parallel.comm if parallel is not None else None
    phase = startup.phase
    # A wait for a shared model cache goes here, inside phase(StartupPhase.MODEL_CACHE).
    with phase(StartupPhase.WEIGHTS):
        model = config.model
        loaded = model_loader.load(
            model.model,
            device,
            dtype,
            model.chat_template,
            comm,
            tokenizer_path=model.tokenizer,
        )
    vocab_size = int(getattr(loaded.model.config, "vocab_size"))  # noqa: B009
    with phase(StartupPhase.KV_PROFILE):
        plan = plan_cache(config, loaded, device, dtype, comm)
    # The sub-configs with the derived values resolved, as the scheduler takes them.
    scheduler = Scheduler(plan.scheduler, plan.cache, config.lora.step_slots)
    max_len, shape = scheduler.max_model_len, plan.shape
    num_blocks, num_cpu_blocks = plan.num_blocks, plan.num_cpu_blocks
    with phase(StartupPhase.KV_ALLOCATE):
        runner = ModelRunner.from_plan(loaded, plan, device, native_linears=comm is None)
    if parallel is not None:
        runner.publish = parallel.publish
    if config.lora.enable_lora:
        # Under tensor parallelism the other ranks repeat this one's adapter changes.
        runner.lora = LoRAModel(loaded.model, config.lora, device, record=parallel is not None)
    logger.info(
        "KV pool: %d blocks x %d tokens of %s (%s scales, %d bytes per token; %.1f MiB per "
        "rank), %d CPU swap blocks, %d host-tier blocks (%.1f MiB per rank), max_model_len %d, "
        "tensor_parallel_size %d",
        num_blocks,
        plan.cache.block_size,
        shape.kv_dtype.value if shape.quantized else str(shape.dtype).removeprefix("torch."),
        runner.kv_scales if shape.quantized else "no",
        shape.bytes_per_token,
        num_blocks * shape.bytes_per_block / 2**20,
        num_cpu_blocks,
        plan.num_host_blocks,
        plan.num_host_blocks * shape.bytes_per_block / 2**20,
        max_len,
        config.parallel.tensor_parallel_size,
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
        rng=torch.Generator().manual_seed(config.seed),
    )
