"""How many CPU threads the engine runs, and how its OpenMP threads wait: owned here.

The thread count (``plan_threads``): ``--threads`` when given; else ``OMP_NUM_THREADS`` when
set (the variable torch itself starts with, so a user's choice stays theirs); else the cgroup's
CPU quota
(``cpu_quota``: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the
tightest of the process's cgroup and its ancestors), rounded down, at least 1, at most the CPUs
the process may run on (``os.sched_getaffinity``); without a quota, those CPUs. torch's own
default is the machine's physical cores, which in a CPU-limited pod on a large node is many more
threads than the pod's quota can run at once.

The wait policy (``prefer_passive_waits``): OpenMP threads that reach a barrier first spin for a
while by default (libgomp: 300,000 spins) before they sleep. On cores that other processes share,
a spinning thread holds a core the thread it waits for needs, and a decode step crosses dozens of
barriers (one per matmul): on a 2-core machine with other work running, two threads ran 6x
slower than one (docs/benchmarks.md, ``bench contention``). Passive waits sleep at once, and a
woken thread costs microseconds per barrier: on cores nobody else uses that cost two threads
about a fifth of their rate, which a dedicated node can buy back with ``GOMP_SPINCOUNT``.
libgomp reads the policy once, when it is loaded (by ``import torch``), so ``quire_engine`` sets
it on import, before torch, unless the user chose a policy or a spin count; ``WaitPolicy``
records which happened, for the start-up log line.

Pure Python (no torch): the engine (``engine.build``) applies the count with
``torch.set_num_threads``, which the native kernels follow too (they run on torch's OpenMP).
"""

from __future__ import annotations

import enum
import functools
import os
import sys
from collections.abc import Container, Iterable, MutableMapping
from pathlib import Path
from typing import NamedTuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# The variables through which a user chooses libgomp's waiting themselves; either one set means
# Quire leaves the policy alone.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


class CgroupVersion(enum.Enum):
    V1 = "v1"
    V2 = "v2"


class CpuQuota(NamedTuple):
    """A CFS bandwidth limit: ``quota_us`` of CPU time per ``period_us`` of wall time."""

    quota_us: int
    period_us: int
    version: CgroupVersion

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us


class ThreadSource(enum.Enum):
    """Where the thread count came from."""

    FLAG = "--threads"
    OMP_NUM_THREADS = "OMP_NUM_THREADS"
    CGROUP_QUOTA = "the cgroup CPU quota"
    AFFINITY = "the CPUs this process may run on"


class WaitPolicy(enum.Enum):
    """What ``prefer_passive_waits`` found and did."""

    SET_PASSIVE = "passive (set by Quire)"
    USER = "the user's (OMP_WAIT_POLICY or GOMP_SPINCOUNT set)"
    TOO_LATE = "libgomp's default (torch was imported before quire_engine)"


class ThreadPlan(NamedTuple):
    """The engine's thread count, its source, and what it was chosen from."""

    threads: int
    source: ThreadSource
    quota: CpuQuota | None
    affinity: int  # CPUs in the process's affinity mask

    def describe(self, waits: WaitPolicy) -> str:
        """The start-up log line, with how OpenMP threads wait (``waits``)."""
        if self.quota is None:
            seen = "no cgroup CPU quota"
        else:
            q = self.quota
            seen = (
                f"cgroup {q.version.value} CPU quota {q.cpus:g} CPUs "
                f"({q.quota_us} us per {q.period_us} us)"
            )
        return (
            f"CPU threads: {self.threads} (from {self.source.value}; {seen}; "
            f"affinity {self.affinity} CPUs); OpenMP waits: {waits.value}"
        )


def plan_threads(
    requested: int | None, quota: CpuQuota | None, affinity: int, omp_num_threads: str | None = None
) -> ThreadPlan:
    """The thread count for ``requested`` (``--threads``; None: derive it), as the module
    docstring says; ``omp_num_threads`` is the variable's text (one that is not a positive
    integer, e.g. a list of nesting levels, is passed over)."""
    if requested is not None:
        return ThreadPlan(requested, ThreadSource.FLAG, quota, affinity)
    text = (omp_num_threads or "").strip()
    if text.isdigit() and int(text) > 0:
        return ThreadPlan(int(text), ThreadSource.OMP_NUM_THREADS, quota, affinity)
    if quota is not None:
        threads = min(max(1, quota.quota_us // quota.period_us), affinity)
        return ThreadPlan(threads, ThreadSource.CGROUP_QUOTA, quota, affinity)
    return ThreadPlan(affinity, ThreadSource.AFFINITY, None, affinity)


def resolve_threads(requested: int | None) -> ThreadPlan:
    """``plan_threads`` with this process's quota, affinity and ``OMP_NUM_THREADS``."""
    affinity = len(os.sched_getaffinity(0))
    return plan_threads(requested, cpu_quota(), affinity, os.environ.get("OMP_NUM_THREADS"))


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> CpuQuota | None:
    """The tightest CPU quota (fewest CPUs) over the process's cgroup and its ancestors, cgroup
    v2 first, else v1; None when none is set (``max``, -1) or none can be read. Inside a
    container's cgroup namespace the process's cgroup is mounted at ``root`` itself; on a host
    it is ``root`` plus the path ``self_cgroup`` names (v1: under the ``cpu`` controller's
    mount)."""
    lines = _read(self_cgroup)
    v2_path = v1_path = "/"
    for line in (lines or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2_path = parts[2]
        elif "cpu" in parts[1].split(","):
            v1_path = parts[2]
    if (root / "cgroup.controllers").exists():
        return _tightest(_v2_quota(d) for d in _ancestry(root, v2_path))
    for mount in ("cpu,cpuacct", "cpu"):
        base = root / mount
        if base.is_dir():
            return _tightest(_v1_quota(d) for d in _ancestry(base, v1_path))
    return None


def _ancestry(base: Path, relative: str) -> list[Path]:
    """``base / relative`` and its parents up to ``base``, those that exist; just ``base`` when
    the process's path is not below it (a container sees its own cgroup at the mount; a path
    outside the cgroup namespace starts with ``/..``)."""
    leaf = base / relative.strip("/")
    if ".." in Path(relative).parts or not leaf.is_dir():
        return [base]
    found = [leaf]
    while found[-1] != base:
        found.append(found[-1].parent)
    return found


def _v2_quota(directory: Path) -> CpuQuota | None:
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _quota(fields[0], fields[1], CgroupVersion.V2)


def _v1_quota(directory: Path) -> CpuQuota | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _quota(quota.strip(), period.strip(), CgroupVersion.V1)


def _quota(quota: str, period: str, version: CgroupVersion) -> CpuQuota | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return CpuQuota(q, p, version) if q > 0 and p > 0 else None  # v1 writes -1 for none


def _tightest(quotas: Iterable[CpuQuota | None]) -> CpuQuota | None:
    found = [q for q in quotas if q is not None]
    return min(found, key=lambda q: q.cpus) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


@functools.cache
def set_up_waits() -> WaitPolicy:
    """``prefer_passive_waits`` for this process, once (the result is kept for
    ``openmp_waits``); called by ``quire_engine``'s ``__init__``, before any module here imports
    torch."""
    return prefer_passive_waits()


def openmp_waits() -> WaitPolicy:
    """How this process's OpenMP threads wait (what ``set_up_waits`` found), for the log."""
    return set_up_waits()


def prefer_passive_waits(
    environ: MutableMapping[str, str] | None = None, modules: Container[str] | None = None
) -> WaitPolicy:
    """Make OpenMP threads sleep at once at a barrier (the module docstring says why) by setting
    ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (default: the process's), unless the user chose a
    policy or torch is among ``modules`` (default: ``sys.modules``; libgomp is loaded then).
    Called by ``quire_engine`` on import; tensor-parallel workers inherit the variable."""
    env = os.environ if environ is None else environ
    if any(name in env for name in WAIT_VARIABLES):
        return WaitPolicy.USER
    if "torch" in (sys.modules if modules is None else modules):
        return WaitPolicy.TOO_LATE
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return WaitPolicy.SET_PASSIVE
