"""Child processes of the test cluster: start with a log file, stop for sure, wait for readiness.

Ownership: a ``ManagedProcess`` owns exactly one child and its log file handle. The log file
itself belongs to the launcher's log directory, which outlives the process so that a failing
test can still show what the component said.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests import waiting
from tests.ports import free_port as free_port  # re-exported: tests.cluster, operator tests

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class ClusterError(RuntimeError):
    """The control plane could not start, or a component died; the message carries log tails."""


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask Linux to SIGKILL it when the parent dies.

    Without this a pytest run killed by a CI time limit (SIGKILL, so no cleanup code runs)
    would leave etcd and the API server holding ports and memory. Best effort: on a system
    without prctl the normal stop path still applies.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    """One control-plane component running in its own session, output going to ``log_path``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = log_path.open("ab")
        # Its own session: Ctrl-C in a terminal reaches only the Python parent, which then stops
        # the components in order (API server before etcd) instead of all dying at once.
        self.popen = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=None if env is None else {**os.environ, **env},  # None: inherit ours
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return self.popen.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; always reaps the child and closes the log."""
        try:
            if self.popen.poll() is None:
                self.popen.terminate()
                try:
                    self.popen.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(timeout=grace_s)
        finally:
            self._log.close()

    def describe_failure(self, lines: int = 40) -> str:
        code = self.exited()
        state = "running" if code is None else f"exited with code {code}"
        header = f"--- {self.name} ({state}); last lines of {self.log_path}:"
        return f"{header}\n{tail(self.log_path, lines)}"


def wait_until(
    what: str,
    check: Callable[[], bool],
    *,
    timeout_s: float,
    watch: Sequence[ManagedProcess],
    interval_s: float = 0.1,
) -> None:
    """Poll ``check`` until it is true; fail fast (with logs) if a watched process exits."""

    def alive_and_done() -> bool:
        for proc in watch:
            if proc.exited() is not None:
                raise ClusterError(
                    f"{proc.name} exited while waiting for {what}\n{proc.describe_failure()}"
                )
        return check()

    def logs() -> str:
        return f"waiting for {what}\n" + "\n".join(proc.describe_failure(20) for proc in watch)

    # OSError: connection refused, TLS not up yet, HTTP errors (the last one is reported).
    waiting.wait_until(
        alive_and_done,
        timeout=timeout_s,
        interval=interval_s,
        message=logs,
        ignore=(OSError,),
        error=ClusterError,
    )


def shm_dir() -> Path | None:
    """``/dev/shm`` when it is a writable tmpfs-like directory (etcd data lives there)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


# Marks a scratch dir with the pid of the Python process that owns it (see sweep_stale).
_OWNER_FILE = ".owner-pid"


def claim(directory: Path) -> Path:
    """Record this process as the owner of ``directory``; returns it."""
    (directory / _OWNER_FILE).write_text(str(os.getpid()))
    return directory


def sweep_stale(parent: Path, prefix: str) -> None:
    """Delete ``parent/prefix*`` dirs whose owning process is gone.

    A SIGKILLed pytest cannot clean up; its components die with it (PDEATHSIG) but its dirs
    would stay, and on /dev/shm they hold RAM. Dirs without an owner file (kept logs, or one
    being created right now) are left alone.
    """
    for candidate in parent.glob(f"{prefix}*"):
        try:
            pid = int((candidate / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(candidate, ignore_errors=True)
        except PermissionError:  # alive, owned by another user
            continue
