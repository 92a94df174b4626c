"""Rank 0's handle on the other tensor-parallel ranks: it starts them, sends them each step's
plan, checks they are alive, and stops them.

Rank 0 is the engine process: it owns the scheduler and the block allocator, so every rank runs
the plan rank 0 decided and the block tables are identical everywhere. The plan reaches the
workers as a pickled ``StepPlan`` (the step's host arrays, a few KiB) over one pipe per worker,
sent before rank 0 starts its own forward pass; the forward's first all-reduce is where the ranks
meet. A pipe rather than a ``torch.distributed`` broadcast: the plan is host data (a broadcast
over NCCL would copy it to the device and back), pickling numpy arrays is one memory copy, the
send does not wait for the workers, and a pipe to a dead worker fails at once (``check``).

Several nodes (``nnodes`` > 1, one per pod of a LeaderWorkerSet group): rank 0's node spawns its
own ranks as above; the ranks of the other nodes are started by their own node
(``parallel/node``) and reach rank 0 through ``rendezvous``: the same store, and a TCP
connection in place of the pipe, carrying the same pickled plans.

Failure: a worker that exits makes rank 0's next send or collective raise (gloo and NCCL see the
peer's sockets close); between steps ``check`` reports it (a dead local process, or a remote
rank's closed connection). Either way the engine dies loudly and its owner fails every request.
A local worker whose pipe closes (rank 0 gone) exits by itself; a remote one exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from quire_engine.core.config import EngineConfig
from quire_engine.model import loader
from quire_engine.model.collectives import C10dGroup, Collectives, new_group
from quire_engine.model.runner import StepPlan
from quire_engine.parallel import rendezvous, worker

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a collective (or the start-up rendezvous) waits at most this
_STOP_GRACE_S = 10.0


class WorkerGroup:
    """Ranks 1..N-1 and rank 0's ``Collectives``: node 0's other ranks as spawned processes
    (one pipe each), the other nodes' ranks as plan connections (one TCP connection each)."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank {parallel.node_rank} serves no requests: only node 0 runs the engine "
                "(run the others with quire-engine serve --headless)"
            )
        world, local = parallel.tensor_parallel_size, parallel.ranks_per_node
        device = worker.rank_device(config, 0)
        if device.type == "cuda" and (device.index or 0) + local > torch.cuda.device_count():
            raise ValueError(
                f"{local} tensor-parallel ranks per node from {device} need {local} CUDA "
                f"devices; this machine has {torch.cuda.device_count()}"
            )
        loader.check_tensor_parallel(config.model.model, world)  # refuse before starting anything
        threads = torch.get_num_threads()
        if device.type == "cpu":
            # Every rank of this node shares its cores.
            threads = max(1, threads // local)
            torch.set_num_threads(threads)
        self.world = world
        self.publish_seconds = 0.0  # pickling and sending plans, summed
        self.steps = 0  # plans sent
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._remote: dict[int, Connection] = {}  # rank -> plan connection, other nodes' ranks
        several = parallel.nnodes > 1
        # The rendezvous lives as long as the group. One node: an ephemeral loopback port.
        self._rendezvous = rendezvous.Rendezvous(
            parallel.master_addr if several else "127.0.0.1",
            parallel.master_port if several else 0,
            world,
            COLLECTIVE_TIMEOUT_S,
            remote=config if several else None,
        )
        store = self._rendezvous.store
        assert store is not None  # closed only by close()
        ctx = mp.get_context("spawn")
        for rank in range(1, local):
            spec = worker.RankSpec(
                rank,
                world,
                self._rendezvous.host,
                self._rendezvous.port,
                threads,
                COLLECTIVE_TIMEOUT_S,
                remote=False,
            )
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker.main,
                args=(spec, config, recv),
                name=f"quire-tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            recv.close()
            self._procs.append(proc)
            self._conns.append(send)
        try:
            group = self._join(store, device)
            if several:
                remote = set(range(local, world))
                self._remote = self._rendezvous.accept(remote, COLLECTIVE_TIMEOUT_S, self.check)
                self._conns.extend(self._remote[rank] for rank in sorted(self._remote))
        except BaseException:
            self.close()
            raise
        self.comm = Collectives(group, 0, world)

    def _join(self, store: dist.Store, device: torch.device) -> C10dGroup:
        """Rank 0's side of the group, built on a thread while this one watches the workers: a
        worker that dies before joining fails start-up at once instead of at the timeout."""
        built: list[C10dGroup] = []
        errors: list[BaseException] = []

        def build() -> None:
            try:
                built.append(new_group(store, 0, self.world, device, COLLECTIVE_TIMEOUT_S))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=build, name="quire-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive():
                self.check()
        if errors:
            raise errors[0]
        return built[0]

    def publish(self, plan: StepPlan) -> None:
        """Send the step's plan to every worker (before rank 0 runs it)."""
        started = time.perf_counter()
        data = ForkingPickler.dumps(plan)  # once for all ranks; ``recv`` unpickles it
        try:
            for conn in self._conns:
                conn.send_bytes(data)
        except OSError as exc:
            self.check()
            raise RuntimeError(f"could not send the step to a tensor-parallel rank: {exc}") from exc
        self.publish_seconds += time.perf_counter() - started
        self.steps += 1

    def check(self) -> None:
        """``RuntimeError`` naming the first worker that is no longer running, or (another
        node's rank) whose connection closed: it never sends anything, so a readable
        connection is an EOF or an error."""
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )
        for rank, conn in self._remote.items():
            try:
                closed = conn.closed or conn.poll(0)
            except OSError:
                closed = True
            if closed:
                raise RuntimeError(f"tensor-parallel rank {rank} (another node) disconnected")

    def blame(self, error: BaseException, wait: float = 2.0) -> None:
        """After a failed step: raise ``RuntimeError`` naming the worker that died (``error``,
        e.g. gloo's "connection reset", as its cause) if one exits within ``wait`` seconds;
        return otherwise (the caller re-raises ``error``)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                self.check()
            except RuntimeError as dead:
                raise dead from error
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    def close(self) -> None:
        """Stop every worker: ask, wait a little, then kill. Idempotent."""
        for conn in self._conns:
            try:
                conn.send(None)
                conn.close()
            except OSError:
                pass
        self._conns = []
        self._remote = {}
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in self._procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self._procs = []
        # The workers are gone: rank 0's group and then the store it was built on go now.
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.close()
        self._rendezvous.close()
