"""The engine's thread count from --threads, the cgroup CPU quota or the affinity mask
(``core.threads``), against fake cgroup trees; and the OpenMP wait policy it prefers."""

from __future__ import annotations

from pathlib import Path

import pytest

from quire_engine.core.threads import (
    CgroupVersion,
    CpuQuota,
    ThreadPlan,
    ThreadSource,
    WaitPolicy,
    cpu_quota,
    plan_threads,
    prefer_passive_waits,
)


def _v2(root: Path, cpu_max: str | None, relative: str = "") -> Path:
    directory = root / relative
    directory.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    if cpu_max is not None:
        (directory / "cpu.max").write_text(cpu_max + "\n")
    return directory


def _self(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self_cgroup"
    path.write_text(text)
    return path


def _v1(root: Path, quota: str | None, period: str | None, mount: str = "cpu,cpuacct") -> None:
    base = root / mount
    base.mkdir(parents=True)
    if quota is not None:
        (base / "cpu.cfs_quota_us").write_text(quota + "\n")
    if period is not None:
        (base / "cpu.cfs_period_us").write_text(period + "\n")


def test_v2_quota_at_the_mount(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v2(root, "250000 100000")
    got = cpu_quota(root, _self(tmp_path, "0::/\n"))
    assert got == CpuQuota(250000, 100000, CgroupVersion.V2)
    assert got.cpus == 2.5


def test_v2_max_is_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v2(root, "max 100000")
    assert cpu_quota(root, _self(tmp_path, "0::/\n")) is None


def test_v2_tightest_of_the_cgroup_and_its_parents(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v2(root, "max 100000")
    _v2(root, "150000 100000", "kubepods/pod1")
    _v2(root, "400000 100000", "kubepods/pod1/ctr")
    got = cpu_quota(root, _self(tmp_path, "0::/kubepods/pod1/ctr\n"))
    assert got == CpuQuota(150000, 100000, CgroupVersion.V2)


def test_v2_path_not_below_the_mount_reads_the_mount(tmp_path: Path) -> None:
    # In a container's cgroup namespace the host path does not exist under the mount.
    root = tmp_path / "cg"
    _v2(root, "100000 100000")
    got = cpu_quota(root, _self(tmp_path, "0::/somewhere/else\n"))
    assert got == CpuQuota(100000, 100000, CgroupVersion.V2)


def test_v2_path_outside_the_namespace_reads_the_mount(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v2(root, "200000 100000")
    (root / "sub").mkdir()
    got = cpu_quota(root, _self(tmp_path, "0::/../sub\n"))
    assert got == CpuQuota(200000, 100000, CgroupVersion.V2)


@pytest.mark.parametrize("text", ["", "garbage\n", "100000\n", "x 100000\n", "0 100000\n"])
def test_v2_unreadable_cpu_max_is_no_quota(tmp_path: Path, text: str) -> None:
    root = tmp_path / "cg"
    _v2(root, None)
    (root / "cpu.max").write_text(text)
    assert cpu_quota(root, _self(tmp_path, "0::/\n")) is None


def test_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v1(root, "50000", "100000")
    got = cpu_quota(root, _self(tmp_path, "4:cpu,cpuacct:/\n"))
    assert got == CpuQuota(50000, 100000, CgroupVersion.V1)
    assert got.cpus == 0.5


def test_v1_cpu_mount_and_nested_cgroup(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v1(root, "-1", "100000", mount="cpu")
    leaf = root / "cpu" / "docker" / "abc"
    leaf.mkdir(parents=True)
    (leaf / "cpu.cfs_quota_us").write_text("300000\n")
    (leaf / "cpu.cfs_period_us").write_text("100000\n")
    got = cpu_quota(root, _self(tmp_path, "7:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n"))
    assert got == CpuQuota(300000, 100000, CgroupVersion.V1)


def test_v1_unlimited_is_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v1(root, "-1", "100000")
    assert cpu_quota(root, _self(tmp_path, "4:cpu,cpuacct:/\n")) is None


def test_v1_missing_period_is_no_quota(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _v1(root, "50000", None)
    assert cpu_quota(root, _self(tmp_path, "4:cpu,cpuacct:/\n")) is None


def test_no_cgroup_files_at_all(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path / "absent", tmp_path / "absent_self") is None


def test_plan_from_the_flag_wins() -> None:
    quota = CpuQuota(100000, 100000, CgroupVersion.V2)
    assert plan_threads(3, quota, 8) == ThreadPlan(3, ThreadSource.FLAG, quota, 8)


@pytest.mark.parametrize(
    ("quota_us", "affinity", "threads"),
    [(250000, 8, 2), (50000, 8, 1), (100000, 8, 1), (800000, 4, 4), (400000, 4, 4)],
)
def test_plan_from_the_quota(quota_us: int, affinity: int, threads: int) -> None:
    quota = CpuQuota(quota_us, 100000, CgroupVersion.V2)
    assert plan_threads(None, quota, affinity) == ThreadPlan(
        threads, ThreadSource.CGROUP_QUOTA, quota, affinity
    )


@pytest.mark.parametrize(
    ("text", "source"),
    [("3", "omp"), (" 3\n", "omp"), ("4,2", "quota"), ("0", "quota"), ("", "quota")],
)
def test_plan_from_omp_num_threads(text: str, source: str) -> None:
    quota = CpuQuota(200000, 100000, CgroupVersion.V2)
    got = plan_threads(None, quota, 8, text)
    if source == "omp":
        assert got == ThreadPlan(3, ThreadSource.OMP_NUM_THREADS, quota, 8)
    else:
        assert got == ThreadPlan(2, ThreadSource.CGROUP_QUOTA, quota, 8)
    assert plan_threads(5, quota, 8, text).source is ThreadSource.FLAG


def test_plan_without_a_quota_is_the_affinity() -> None:
    assert plan_threads(None, None, 6) == ThreadPlan(6, ThreadSource.AFFINITY, None, 6)


def test_log_line_names_count_source_quota_and_waits() -> None:
    quota = CpuQuota(150000, 100000, CgroupVersion.V1)
    line = plan_threads(None, quota, 4).describe(WaitPolicy.SET_PASSIVE)
    assert line == (
        "CPU threads: 1 (from the cgroup CPU quota; cgroup v1 CPU quota 1.5 CPUs (150000 us per "
        "100000 us); affinity 4 CPUs); OpenMP waits: passive (set by Quire)"
    )
    line = plan_threads(2, None, 4).describe(WaitPolicy.USER)
    assert line.startswith("CPU threads: 2 (from --threads; no cgroup CPU quota; affinity 4")


def test_passive_waits_set_before_torch() -> None:
    env: dict[str, str] = {}
    assert prefer_passive_waits(env, modules=()) is WaitPolicy.SET_PASSIVE
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("name", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT"])
def test_the_users_policy_is_kept(name: str) -> None:
    env = {name: "ACTIVE" if name == "OMP_WAIT_POLICY" else "300000"}
    assert prefer_passive_waits(env, modules=("torch",)) is WaitPolicy.USER
    assert env == {name: env[name]}


def test_too_late_after_torch() -> None:
    env: dict[str, str] = {}
    assert prefer_passive_waits(env, modules=("torch",)) is WaitPolicy.TOO_LATE
    assert env == {}
