"""The one free-port helper of the tests: ``free_port``.

Every test that starts something listening on loopback (an engine process, a rendezvous, a
control-plane component) picks its port here.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    There is a short window before the component binds it; on a test machine that race is
    rare, and a lost race shows up as a clear "address already in use" in the component's log.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
