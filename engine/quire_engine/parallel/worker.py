"""The process of one tensor-parallel rank other than 0.

It joins the group, loads its shard of the model (``loader.load`` with its ``Collectives``),
sizes its KV pool with the others (``plan_cache``), then runs every ``StepPlan`` rank 0 sends,
in order, through its own ``ModelRunner``: the same block moves and the same forward pass as
rank 0, whose all-reduces it takes part in, after repeating the plan's adapter changes on its
own ``LoRAModel`` (its shard of each adapter). It owns nothing else: no scheduler, no sampler.

The plans come over a pipe from rank 0 when this rank lives on node 0 (rank 0 spawned it), and
over a TCP connection to node 0 (``rendezvous.connect_plans``) when it lives on another node.
It exits 0 when rank 0 sends ``None``; when the connection closes without it (rank 0 is gone)
a local rank exits 0 (its parent is gone too) and a remote one raises, exiting non-zero so that
its node, and the pod, fail. Any error exits non-zero, which rank 0 sees as a failed collective,
a dead process or a closed connection.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch

from quire_engine.core.config import EngineConfig
from quire_engine.cpu import bf16 as bf16_cpu
from quire_engine.model import loader
from quire_engine.model.cache_plan import plan_cache
from quire_engine.model.collectives import Collectives, new_group
from quire_engine.model.lora import LoRAModel
from quire_engine.model.runner import ModelRunner
from quire_engine.parallel import rendezvous

logger = logging.getLogger(__name__)


class RankSpec(NamedTuple):
    """What a rank needs to join its group."""

    rank: int
    world: int
    host: str  # node 0's address: its TCPStore and, for a remote rank, its plan listener
    port: int  # node 0's TCPStore
    threads: int  # intra-op threads on CPU
    timeout: float  # seconds a collective (or the rendezvous) may wait
    remote: bool  # on another node than rank 0: plans come over TCP, not a pipe


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``r`` runs on its node's ``r % ranks_per_node``-th device after the configured one
    (``cuda:N`` -> N + that)."""
    device = loader.resolve_device(config.model.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank % config.parallel.ranks_per_node)
    return device


def main(spec: RankSpec, config: EngineConfig, conn: Connection | None) -> None:
    """The worker's entry point (``multiprocessing`` spawn target); ``conn``: the pipe from
    rank 0, None for a remote rank (it connects to node 0 once the group is built)."""
    logging.basicConfig(level=logging.INFO, format=f"rank {spec.rank}: %(levelname)s %(message)s")
    torch.set_num_threads(spec.threads)
    store = rendezvous.join(spec.host, spec.port, spec.world, spec.timeout)
    if spec.remote:
        config = rendezvous.leader_config(store, config)
    device = rank_device(config, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = new_group(store, spec.rank, spec.world, device, spec.timeout)
    comm = Collectives(group, spec.rank, spec.world)
    if conn is None:
        conn = rendezvous.connect_plans(store, spec.host, spec.rank, spec.timeout)
    model = config.model
    dtype = loader.resolve_dtype(model.dtype, device)
    bf16_cpu.log_support(device, dtype)  # this node's CPU, which may not be rank 0's
    loaded = loader.load(
        model.model,
        device,
        dtype,
        model.chat_template,
        comm,
        tokenizer_path=model.tokenizer,
    )
    cache = plan_cache(config, loaded, device, dtype, comm)
    runner = ModelRunner.from_plan(loaded, cache, device, native_linears=False)
    if config.lora.enable_lora:  # its shard of rank 0's adapters, changed as the plans say
        runner.lora = LoRAModel(loaded.model, config.lora, device)
    logger.info("rank %d of %d ready on %s", spec.rank, spec.world, device)
    while True:
        try:
            plan = conn.recv()
        except EOFError:  # rank 0 is gone
            if spec.remote:
                raise RuntimeError(f"rank {spec.rank}: node 0 closed the connection") from None
            return
        if plan is None:
            return
        if plan.adapters:
            assert runner.lora is not None, "adapter changes for a rank without LoRA"
            runner.lora.follow(plan.adapters)
        runner.run(plan)
