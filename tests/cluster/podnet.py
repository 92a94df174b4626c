"""Pod addresses on loopback: each test cluster's pods get unique ``127.N.x.y`` addresses.

On Linux the whole of 127.0.0.0/8 is routed to the loopback interface, so a process can bind
any ``127.x.y.z`` without privileges or setup. Giving every kwok pod such an address lets a real
process (an engine, the Endpoint Picker) listen on its own pod's IP and on the container's port
(the same port for every pod, as on a real cluster), and lets anything that reads pod IPs from
the API (the Endpoint Picker, Envoy's original-destination cluster) reach it.

How kwok assigns them: its pod controller takes the next free address of the pod's node's
``spec.podCIDR`` (kwok's ``--cidr`` for a node without one), starting at the network's first
host address and reusing the addresses of deleted pods. So each fake node gets a /24 of this
cluster's /16 as its podCIDR (the node IPAM controller is not running, so nothing else sets it).

Ownership: a ``PodNetwork`` holds an exclusive lock on ``$TMPDIR/quire-podnet-127.N.lock`` for
its /16 while its cluster runs, so concurrent test clusters on one machine (parallel sessions,
other users) never hand out the same address; ``release`` drops it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import tempfile
from pathlib import Path
from typing import IO


class PodNetworkError(RuntimeError):
    """Every 127.N.0.0/16 is taken by other running clusters."""


class PodNetwork:
    """One /16 of 127.0.0.0/8 (never 127.0.0.0/16, which holds 127.0.0.1)."""

    def __init__(self) -> None:
        self._lock: IO[str] | None = None
        self.second_octet = 0
        # Start at a random /16 so that concurrent clusters rarely contend for the same lock.
        first = random.randrange(1, 255)
        for offset in range(254):
            octet = 1 + (first - 1 + offset) % 254
            handle = (Path(tempfile.gettempdir()) / f"quire-podnet-127.{octet}.lock").open("w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                continue
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            self._lock, self.second_octet = handle, octet
            return
        raise PodNetworkError("no free 127.N.0.0/16 for pod IPs: 254 test clusters running?")

    @property
    def cidr(self) -> str:
        """The whole /16, e.g. ``127.42.0.0/16``."""
        return f"127.{self.second_octet}.0.0/16"

    @property
    def default_cidr(self) -> str:
        """kwok's ``--cidr``: pods of nodes without a podCIDR (``127.N.0.0/24``)."""
        return self.node_cidr(-1)

    def node_cidr(self, index: int) -> str:
        """The podCIDR of the ``index``-th fake node: ``127.N.<index + 1>.0/24``."""
        if not -1 <= index < 254:
            raise ValueError(f"node index {index} outside 0..253")
        return f"127.{self.second_octet}.{index + 1}.0/24"

    def contains(self, ip: str) -> bool:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(self.cidr)

    def release(self) -> None:
        """Give the /16 back (idempotent); the lock file stays, empty locks cost nothing."""
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
