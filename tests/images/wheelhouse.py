"""The wheelhouse: the wheels the Dockerfiles' ``pip install`` takes from the host, not the web.

Ownership: this module owns ``wheels/<kind>/`` in the store and the pip configuration file the
build mounts (never bakes) into every ``RUN``.

Why not mount the host's pip cache: the Dockerfiles set ``PIP_NO_CACHE_DIR=1`` (so no cache is
baked into a layer), and pip then ignores any cache directory whatever its configuration says.
A ``find-links`` in a pip configuration file is not affected by that, and pip prefers a
find-links file over an index file of the same version and tags. So before the build the host's
pip downloads the project's dependencies into the wheelhouse (through the host's pip cache, which
the test virtualenv's install already filled with torch and the CUDA wheels), and the build mounts
the wheelhouse and a ``pip.conf`` naming it. pip inside the build still resolves against PyPI,
exactly as the Dockerfile says; only where the bytes come from changes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.images.host import run_checked

ROOT = Path(__file__).resolve().parents[2]
# Where the build mounts the wheelhouse, and the pip.conf naming it (a site-wide pip config
# directory: pip reads $XDG_CONFIG_DIRS/pip/pip.conf, /etc/xdg by default).
MOUNTED_WHEELS = "/wheelhouse"
MOUNTED_CONFIG_DIR = "/etc/xdg/pip"
PIP_CONF = f"[global]\nfind-links = {MOUNTED_WHEELS}\n"
# pip download's lines for each file of the resolution.
KEPT = re.compile(r"^(?:Saved|File was already downloaded) (?P<path>\S+)$", re.M)


def fill(extra: str, wheels: Path, python_minor: str) -> Path | None:
    """Download ``.[extra]``'s dependencies into ``wheels`` and drop the files no longer needed;
    returns the pip config directory to mount, or None when this interpreter is not the image's
    Python (its wheels would not fit: the build then downloads what it needs itself)."""
    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    if ours != python_minor:
        print(f"tests.images: no wheelhouse (Python {ours} here, {python_minor} in the image)")
        return None
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"tests.images: filling the wheelhouse for .[{extra}] from pip's cache", flush=True)
    argv = [sys.executable, "-m", "pip", "download", "--dest", str(wheels), f"{ROOT}[{extra}]"]
    out = run_checked(["nice", "-n", "19", *argv], "pip download", quiet=True)
    kept = {Path(match["path"]).name for match in KEPT.finditer(out)}
    if not kept:
        raise RuntimeError(f"pip download listed no files; its output:\n{out[-3000:]}")
    for stale in wheels.iterdir():
        if stale.is_file() and stale.name not in kept:
            stale.unlink()
    config = wheels.parent / f"{wheels.name}.pip"
    config.mkdir(exist_ok=True)
    (config / "pip.conf").write_text(PIP_CONF)
    return config


def volumes(wheels: Path, config: Path) -> list[str]:
    """``buildah bud`` flags mounting the wheelhouse and its pip.conf, read-only, into RUNs."""
    return [
        f"--volume={wheels}:{MOUNTED_WHEELS}:ro",
        f"--volume={config}:{MOUNTED_CONFIG_DIR}:ro",
    ]
