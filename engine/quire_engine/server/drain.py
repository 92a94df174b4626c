"""Graceful shutdown: the drain that SIGTERM starts.

On SIGTERM (Kubernetes deleting the pod, after its ``preStop`` delay) the server keeps listening
while it drains: ``/ready`` turns 503 at once so no new traffic is routed to it, new requests get
503 ``shutting_down`` with ``Retry-After``, and requests in flight get up to ``timeout`` seconds
(``--shutdown-timeout``) to finish. Those still open at the deadline are ended: a stream gets an
error event and ``[DONE]``, a non-streaming request a 503. Then uvicorn shuts down (closing the
listener) and the process exits 0. The operator sets ``terminationGracePeriodSeconds`` to the
``preStop`` delay plus this timeout plus a margin, so the kubelet's SIGKILL never cuts a drain.

Ownership: one ``Drain`` per app, run on the event loop; ``run`` is idempotent (a second SIGTERM
while draining does not restart the clock).
"""

from __future__ import annotations

import asyncio
import logging
import time

from quire_engine.engine.async_engine import AsyncEngine, EngineUnavailable

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
_POLL_S = 0.05


class Drain:
    def __init__(self, engine: AsyncEngine, timeout: float) -> None:
        if not timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds; got {timeout}")
        self.engine = engine
        self.timeout = timeout
        self._task: asyncio.Task[int] | None = None

    async def run(self) -> int:
        """Drain; returns how many requests were still open at the deadline and were ended."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())
        return await asyncio.shield(self._task)

    async def _drain(self) -> int:
        engine = self.engine
        engine.begin_drain()
        start = time.monotonic()
        deadline = start + self.timeout
        logger.info(
            "shutting down: %d requests in flight, waiting up to %.0f s for them",
            engine.num_in_flight,
            self.timeout,
        )
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        left = engine.num_in_flight
        if left:
            logger.warning(
                "shutdown timeout (%.0f s) reached: ending %d requests still in flight",
                self.timeout,
                left,
            )
            engine.fail_open(
                EngineUnavailable(
                    f"the server shut down before the request finished (shutdown timeout "
                    f"{self.timeout:g} s); retry it",
                    code="shutting_down",
                    retry_after=1,
                )
            )
        else:
            logger.info("drained in %.1f s", time.monotonic() - start)
        return left
