"""Where the tensor-parallel ranks meet: node 0's listening sockets, and how ranks of other nodes
join them.

Node 0 (the engine process, rank 0) owns two listening sockets on its address: the c10d
``TCPStore`` (every rank publishes its gloo or NCCL address there; on ``master_port`` when there
are several nodes, an ephemeral loopback port otherwise) and, with several nodes, the plan
listener (an ephemeral port, published in the store together with a random token) and its
``EngineConfig`` (a remote rank runs node 0's, so pool sizes and limits agree by construction;
only its node's fields are its own). A rank of another node connects to the store, reads the
config, builds its group, then opens one TCP connection to the plan
listener and greets it with ``"<rank> <token>"``; from then on node 0 sends it every step's plan
over that connection exactly as it sends its local ranks theirs over a pipe: both are a
``multiprocessing.connection.Connection``. Node 0 reads only that greeting from a remote rank
(bytes, never unpickled); a remote rank unpickles what node 0 sends, as local ranks do.

Both sides of a plan connection turn on TCP keepalive (a vanished peer is found within about
25 s, without any traffic), and node 0 finds a closed one at once (``poll`` sees the EOF).
The store and the listener are unauthenticated, like torch's own rendezvous: only the group's
pods should reach node 0's ports.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection

import torch.distributed as dist

from quire_engine.core.config import EngineConfig

logger = logging.getLogger(__name__)

PLAN_KEY = "quire/plan-listener"  # store key: "<port> <token>"
CONFIG_KEY = "quire/config"  # store key: node 0's pickled EngineConfig
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}  # seconds, seconds, probes
_WILDCARD = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def local_address(host: str) -> str:
    """Where a process on node 0 reaches a socket bound to ``host`` (a wildcard -> loopback)."""
    return _WILDCARD.get(host, host)


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise RuntimeError(
            f"cannot listen for tensor-parallel ranks on {host}:{port}: {exc}"
        ) from exc
    sock.listen(64)
    return sock


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Rendezvous:
    """Node 0's side: the store (``store``) and, when ``remote`` is set, the plan listener."""

    def __init__(
        self, host: str, port: int, world: int, timeout: float, remote: EngineConfig | None
    ) -> None:
        """``remote``: node 0's config when other nodes will join, None for one node."""
        self.host = local_address(host)  # where node 0's own ranks reach the store
        self._store_socket = _listen(host, port)
        self.port = self._store_socket.getsockname()[1]
        self.store: dist.TCPStore | None = dist.TCPStore(
            self.host,
            self.port,
            world,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=self._store_socket.fileno(),
        )
        self._plans: socket.socket | None = None
        self._token = secrets.token_hex(16)
        if remote is not None:
            assert self.store is not None
            self.store.set(CONFIG_KEY, pickle.dumps(remote))  # type: ignore[arg-type]
            self._plans = _listen(host, 0)
            self.store.set(PLAN_KEY, f"{self._plans.getsockname()[1]} {self._token}")

    def accept(
        self, ranks: set[int], timeout: float, check: Callable[[], None]
    ) -> dict[int, Connection]:
        """One plan connection per rank of ``ranks`` (the other nodes' ranks), calling ``check``
        (which raises when a local rank died) while waiting; ``RuntimeError`` after
        ``timeout`` seconds."""
        assert self._plans is not None
        self._plans.settimeout(0.2)
        deadline = time.monotonic() + timeout
        conns: dict[int, Connection] = {}
        try:
            while len(conns) < len(ranks):
                check()
                if time.monotonic() > deadline:
                    missing = sorted(ranks - conns.keys())
                    raise RuntimeError(f"tensor-parallel ranks {missing} never connected")
                try:
                    sock, peer = self._plans.accept()
                except TimeoutError:
                    continue
                rank = self._greeting(sock, deadline)
                if rank not in ranks or rank in conns:
                    logger.warning("refused a plan connection from %s (rank %s)", peer, rank)
                    sock.close()
                    continue
                _keepalive(sock)
                sock.settimeout(None)
                conns[rank] = Connection(sock.detach())
        except BaseException:
            for conn in conns.values():
                conn.close()
            raise
        return conns

    def _greeting(self, sock: socket.socket, deadline: float) -> int | None:
        """The rank a new connection names, or None (a bad token, garbage, or silence)."""
        sock.settimeout(max(deadline - time.monotonic(), 0.1))
        data = b""
        try:
            while not data.endswith(b"\n") and len(data) < 256:
                chunk = sock.recv(256 - len(data))
                if not chunk:
                    return None
                data += chunk
        except OSError:
            return None
        text = data.decode("ascii", "replace").split()
        if (
            len(text) != 2
            or not text[0].isdigit()
            or not secrets.compare_digest(text[1], self._token)
        ):
            return None
        return int(text[0])

    def close(self) -> None:
        if self._plans is not None:
            self._plans.close()
            self._plans = None
        # The store's server thread stops when the object goes (nothing else holds it once the
        # group is closed); left to interpreter exit, it can hang it. The store owns the
        # listening descriptor it was given and closes it as it goes.
        if self.store is not None:
            self._store_socket.detach()
            self.store = None
        self._store_socket.close()


def join(host: str, port: int, world: int, timeout: float) -> dist.TCPStore:
    """A rank's client of node 0's store (retries until node 0 listens, for ``timeout`` s)."""
    return dist.TCPStore(
        host,
        port,
        world,
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def leader_config(store: dist.Store, mine: EngineConfig) -> EngineConfig:
    """Node 0's config with this node's own fields; ``ValueError`` when the two disagree on the
    group's shape (the nodes were started with different flags)."""
    theirs: EngineConfig = pickle.loads(store.get(CONFIG_KEY))
    ours, leaders = mine.parallel, theirs.parallel
    shape = ("tensor_parallel_size", "nnodes")
    if any(getattr(leaders, name) != getattr(ours, name) for name in shape):
        raise ValueError(
            f"node {ours.node_rank} has tensor_parallel_size={ours.tensor_parallel_size}, "
            f"nnodes={ours.nnodes} but node 0 has tensor_parallel_size="
            f"{leaders.tensor_parallel_size}, nnodes={leaders.nnodes}"
        )
    parallel = dataclasses.replace(leaders, node_rank=ours.node_rank, master_addr=ours.master_addr)
    return dataclasses.replace(theirs, parallel=parallel)


def connect_plans(store: dist.Store, host: str, rank: int, timeout: float) -> Connection:
    """A remote rank's plan connection to node 0 (``host``: node 0's address), greeted."""
    port, token = store.get(PLAN_KEY).decode("ascii").split()
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    _keepalive(sock)
    sock.sendall(f"{rank} {token}\n".encode("ascii"))
    sock.settimeout(None)
    return Connection(sock.detach())
