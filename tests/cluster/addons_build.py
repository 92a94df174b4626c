"""Build or fetch the autoscaling add-ons: KEDA, prometheus-adapter and Prometheus.

Same cache and rules as ``build`` (one directory per component and version under
``cache_root()``, complete or absent), but separate from ``ensure_binaries`` so the operator
tests never wait for them: only the autoscaling end-to-end tests (tests/e2e) and
``python -m tests.cluster up --autoscaling`` call ``ensure_autoscaling_binaries``.

- KEDA (operator + metrics API server + its CRDs) and prometheus-adapter are built from their Go
  modules (``_Builder.keda`` / ``_Builder.prometheus_adapter`` in build.py).
- Prometheus is Debian's package, unpacked with ``apt-get download`` + ``dpkg-deb -x`` (no root,
  nothing installed system-wide); a ``prometheus`` already on PATH is used as is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .build import (
    KEDA_BINARIES,
    KEDA_VERSION,
    PROMETHEUS_ADAPTER_VERSION,
    PROMETHEUS_PACKAGE,
    BuildError,
    Log,
    _addon_builder,
    _component_dir,
    _locked,
    _stderr,
    cache_root,
)


@dataclass(frozen=True)
class AutoscalingBinaries:
    keda_operator: Path
    keda_adapter: Path
    keda_crds: tuple[Path, ...]  # keda.sh and eventing.keda.sh CRDs, from KEDA's module source
    prometheus_adapter: Path
    prometheus: Path


def _keda_dir() -> Path:
    return _component_dir("keda", KEDA_VERSION)


def _adapter_path() -> Path:
    return _component_dir("prometheus-adapter", PROMETHEUS_ADAPTER_VERSION) / "prometheus-adapter"


def _cached_prometheus() -> Path | None:
    """The newest unpacked package in the cache, else a ``prometheus`` on PATH."""
    versions = sorted(cache_root().glob(f"{PROMETHEUS_PACKAGE}/*/prometheus"))
    if versions:
        return versions[-1]
    found = shutil.which("prometheus")
    return Path(found) if found else None


def find_autoscaling_binaries() -> AutoscalingBinaries | None:
    keda = _keda_dir()
    crds = tuple(sorted((keda / "crds").glob("*.yaml")))
    prometheus = _cached_prometheus()
    files = [keda / name for name in KEDA_BINARIES] + [_adapter_path()]
    if prometheus is None or not crds or not all(path.is_file() for path in files):
        return None
    return AutoscalingBinaries(
        keda_operator=keda / "operator",
        keda_adapter=keda / "adapter",
        keda_crds=crds,
        prometheus_adapter=_adapter_path(),
        prometheus=prometheus,
    )


def ensure_autoscaling_binaries(log: Log | None = None) -> AutoscalingBinaries:
    """Every add-on, building or fetching what is missing (KEDA: tens of minutes cold).

    Raises ``GoUnavailable`` without a usable Go, ``BuildError`` when a build or the package
    download fails.
    """
    say: Log = log or _stderr
    found = find_autoscaling_binaries()
    if found is not None:
        return found
    cache_root().mkdir(parents=True, exist_ok=True)
    with _locked(cache_root() / ".build-autoscaling.lock"):
        if _cached_prometheus() is None:
            _fetch_prometheus(say)
        needed = []
        if not all((_keda_dir() / name).is_file() for name in KEDA_BINARIES):
            needed.append("keda")
        if not _adapter_path().is_file():
            needed.append("prometheus-adapter")
        if needed:
            builder = _addon_builder(needed, "--autoscaling", say)
            steps = {"keda": builder.keda, "prometheus-adapter": builder.prometheus_adapter}
            for component in needed:
                steps[component]()
    found = find_autoscaling_binaries()
    if found is None:
        raise BuildError("autoscaling add-ons built but still incomplete; see the log above")
    return found


def _fetch_prometheus(log: Log) -> None:
    """``apt-get download prometheus`` into a scratch dir and keep only the server binary."""
    apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or dpkg is None:
        raise BuildError(
            "Prometheus is needed for the autoscaling tests: put a `prometheus` (>= 2.42) on "
            "PATH, or run on a Debian-based system where `apt-get download prometheus` works"
        )
    with tempfile.TemporaryDirectory(prefix="quire-prometheus-") as scratch:
        log(f"[build] prometheus: apt-get download {PROMETHEUS_PACKAGE} ...")
        download = [apt, "download", PROMETHEUS_PACKAGE]
        proc = subprocess.run(download, cwd=scratch, capture_output=True, text=True, check=False)
        if proc.returncode != 0 and os.geteuid() == 0:
            # A fresh machine has no package lists yet (CI runs as root): fetch them once, retry.
            log("[build] prometheus: apt-get update (no package lists yet) ...")
            subprocess.run([apt, "update", "-qq"], capture_output=True, text=True, check=False)
            proc = subprocess.run(
                download, cwd=scratch, capture_output=True, text=True, check=False
            )
        debs = sorted(Path(scratch).glob(f"{PROMETHEUS_PACKAGE}_*.deb"))
        if proc.returncode != 0 or not debs:
            raise BuildError(
                f"`apt-get download {PROMETHEUS_PACKAGE}` failed ({proc.returncode}): "
                f"{proc.stderr.strip()}; run `apt-get update` first, or put a `prometheus` on PATH"
            )
        version = subprocess.run(
            [dpkg, "-f", str(debs[0]), "Version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        unpacked = Path(scratch, "x")
        subprocess.run([dpkg, "-x", str(debs[0]), str(unpacked)], check=True)
        binary = unpacked / "usr" / "bin" / "prometheus"
        if not binary.is_file():
            raise BuildError(f"{debs[0].name} holds no usr/bin/prometheus")
        final = _component_dir(PROMETHEUS_PACKAGE, version.replace("+", "_").replace("~", "_"))
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".prometheus-", dir=final.parent))
        shutil.copy2(binary, staging / "prometheus")
        staging.chmod(0o755)
        staging.rename(final)
        log(f"[build] prometheus {version}: unpacked into {final}")
