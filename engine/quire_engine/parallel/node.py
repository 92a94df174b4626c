"""A headless node (``quire-engine serve --headless``): the tensor-parallel ranks of one node other
than node 0, and nothing else (no HTTP, no scheduler).

Node ``k`` of ``nnodes`` runs ranks ``k * per .. k * per + per - 1`` (``per`` =
``ranks_per_node``), each a spawned ``worker`` process that joins node 0's store at
``master_addr``:``master_port`` and takes its plans over its own connection to node 0. This
process owns those processes and only watches them: when one exits non-zero (its group broke,
node 0 vanished) it kills the others and returns 1, so the pod fails and its LeaderWorkerSet
restarts the group; when all exit 0 (node 0 stopped them) it returns 0. SIGTERM stops them and
returns 0.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from quire_engine.core.config import EngineConfig
from quire_engine.core.threads import openmp_waits, resolve_threads
from quire_engine.parallel import worker
from quire_engine.parallel.group import COLLECTIVE_TIMEOUT_S

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


def start(config: EngineConfig) -> list[BaseProcess]:
    """Spawn this node's ranks (``ValueError`` on node 0, which the engine runs)."""
    parallel = config.parallel
    if parallel.node_rank == 0:
        raise ValueError("node 0 runs the engine: --headless needs --node-rank >= 1")
    per = parallel.ranks_per_node
    plan = resolve_threads(parallel.threads)
    logger.info("%s", plan.describe(openmp_waits()))
    threads = plan.threads
    if worker.rank_device(config, 0).type == "cpu":
        threads = max(1, threads // per)
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    first = parallel.node_rank * per
    for rank in range(first, first + per):
        spec = worker.RankSpec(
            rank,
            parallel.tensor_parallel_size,
            parallel.master_addr,
            parallel.master_port,
            threads,
            COLLECTIVE_TIMEOUT_S,
            remote=True,
        )
        proc = ctx.Process(
            target=worker.main, args=(spec, config, None), name=f"quire-tp-rank-{rank}"
        )
        proc.start()
        procs.append(proc)
    return procs


def stop(procs: list[BaseProcess]) -> None:
    """Terminate, wait a little, then kill."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def run(config: EngineConfig) -> int:
    """Run this node's ranks until they end; the exit code (see the module docstring)."""
    stopping: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    procs = start(config)
    parallel = config.parallel
    logger.info(
        "node %d of %d: ranks %s, node 0 at %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        [p.name for p in procs],
        parallel.master_addr,
        parallel.master_port,
    )
    try:
        running = list(procs)
        while running and not stopping:
            wait([p.sentinel for p in running], timeout=0.5)
            for proc in [p for p in running if not p.is_alive()]:
                running.remove(proc)
                if proc.exitcode != 0:
                    logger.error("%s exited with code %s; stopping", proc.name, proc.exitcode)
                    return 1
        if stopping:
            logger.info("received %s: stopping", signal.Signals(stopping[0]).name)
        return 0
    finally:
        stop(procs)
        signal.signal(signal.SIGTERM, previous)
