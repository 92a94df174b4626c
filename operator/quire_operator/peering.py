"""kopf peering seen from the operator's own threads: the peering objects, and who is active.

kopf keeps all but the highest-priority operator replica paused, but only for its own watches
and handlers; the requeue thread (requeue.py) must ask the same question itself. ``PeeringGate``
answers it from the peering objects with kopf's rule: a replica works while no other live peer
(last keep-alive within its lifetime) has a priority equal to or higher than its own. With
several namespaces it must win in every one (kopf pauses the whole operator otherwise).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from quire_operator.children import TIMEOUT, api_message

PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"


def ensure_peering(api: client.ApiClient, name: str, namespaces: Sequence[str] | None) -> None:
    """Create the peering object(s) if missing: without one, kopf runs every replica at once."""
    custom = client.CustomObjectsApi(api)
    kind = "ClusterKopfPeering" if namespaces is None else "KopfPeering"
    body = {
        "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}",
        "kind": kind,
        "metadata": {"name": name},
    }
    for namespace in [None] if namespaces is None else namespaces:
        try:
            if namespace is None:
                custom.create_cluster_custom_object(
                    PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings", body
                )
            else:
                custom.create_namespaced_custom_object(
                    PEERING_GROUP, PEERING_VERSION, namespace, "kopfpeerings", body
                )
        except ApiException as err:
            if err.status == 409:  # exists already: another replica or an earlier run made it
                continue
            if err.status == 404:
                raise SystemExit(
                    "quire-operator: kopf's peering CRDs are not installed "
                    "(kubectl apply -f crds/kopfpeerings.kopf.dev.yaml), or pass --standalone"
                ) from err
            message = f"quire-operator: cannot create the peering object: {api_message(err)}"
            raise SystemExit(message) from err


def wins(peers: Mapping[str, Mapping[str, Any]], identity: str, priority: int, now: float) -> bool:
    """kopf's rule on one peering object's status ({identity: {priority, lastseen, lifetime}}):
    no other live peer has a priority >= ours. ``now`` in epoch seconds."""
    for other, info in peers.items():
        if other == identity:
            continue
        lastseen = datetime.datetime.fromisoformat(str(info["lastseen"])).timestamp()
        alive = lastseen + int(info.get("lifetime", 60)) > now
        if alive and int(info.get("priority", 0)) >= priority:
            return False
    return True


class PeeringGate:
    """``active()``: whether this replica is the one kopf lets work. Cached for ``ttl_s`` (the
    answer changes on a keep-alive timescale; a resync asks it once per object). An unreadable
    peering object counts as not active: doing nothing is the safe side."""

    def __init__(
        self,
        api: client.ApiClient,
        name: str,
        namespaces: Sequence[str] | None,
        identity: str,
        priority: int,
        ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._custom = client.CustomObjectsApi(api)
        self._name, self._namespaces = name, namespaces
        self._identity, self._priority = identity, priority
        self._ttl_s, self._clock = ttl_s, clock
        self._lock = threading.Lock()
        self._cached: tuple[float, bool] | None = None

    def active(self) -> bool:
        with self._lock:
            if self._cached is not None and self._clock() - self._cached[0] < self._ttl_s:
                return self._cached[1]
            answer = self._read()
            self._cached = (self._clock(), answer)
            return answer

    def _read(self) -> bool:
        now = time.time()
        try:
            for namespace in [None] if self._namespaces is None else self._namespaces:
                if namespace is None:
                    obj = self._custom.get_cluster_custom_object(
                        PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings", self._name,
                        _request_timeout=TIMEOUT,
                    )  # fmt: skip
                else:
                    obj = self._custom.get_namespaced_custom_object(
                        PEERING_GROUP, PEERING_VERSION, namespace, "kopfpeerings", self._name,
                        _request_timeout=TIMEOUT,
                    )  # fmt: skip
                peers = obj.get("status") or {} if isinstance(obj, dict) else {}
                if not wins(peers, self._identity, self._priority, now):
                    return False
        except (ApiException, OSError):
            return False
        return True
