"""The wheelhouse: the wheels the Dockerfiles' ``pip install`` takes from the host, not the web.

Ownership: this module owns ``wheels/<kind>/`` in the store and the pip configuration the build
mounts (never bakes) into every ``RUN`` (``pip/<kind>/``: pip.conf and the host's CA bundle).

Why not mount the host's pip cache: the Dockerfiles set ``PIP_NO_CACHE_DIR=1`` (so no cache is
baked into a layer), and pip then ignores any cache directory whatever its configuration says.
A pip configuration file is read all the same. So before the build the host's pip resolves and
downloads the project's dependencies (and its build requirements) into the wheelhouse, through
the host's pip cache, which the test virtualenv's install already filled with torch and the CUDA
wheels; the build mounts the wheelhouse and a ``pip.conf`` with ``find-links`` to it and
``no-index`` (where: see MOUNTED_WHEELS). ``no-index`` because pip's resolver takes an index file
over a find-links file of the same version, so without it torch came from PyPI again. pip in the
build thus resolves the Dockerfile's requirement against the set the host resolved from PyPI
moments before, for the same Python minor version and platform (no wheelhouse otherwise). The
wheelhouse lives in ~/.cache/quire, which CI keeps, so it outlasts pip's cache too.
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import sys
import tomllib
from pathlib import Path

from tests.images.host import run_checked

ROOT = Path(__file__).resolve().parents[2]
# Where the build mounts the wheelhouse and pip's configuration: directories every Debian base
# already has, because buildah leaves the mount point of a RUN's volume in the layer when it had
# to create it. /mnt is empty there; root's home only holds .bashrc and .profile (unused by the
# RUNs' non-interactive shell), and pip reads the user config $HOME/.config/pip/pip.conf.
MOUNTED_WHEELS = "/mnt"
MOUNTED_HOME = "/root"
PIP_DIR = ".config/pip"
# pip download's lines for each file of the resolution.
KEPT = re.compile(r"^\s*(?:Saved|File was already downloaded) (?P<path>\S+)$", re.M)


def fill(extra: str, wheels: Path, python_minor: str) -> bool:
    """Download ``.[extra]``'s dependencies (and the project's build requirements) into
    ``wheels`` and drop the files no longer needed; False, and nothing done, when this
    interpreter is not the image's Python (its wheels would not fit: the build then downloads
    what it needs itself)."""
    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    if ours != python_minor:
        print(f"tests.images: no wheelhouse (Python {ours} here, {python_minor} in the image)")
        return False
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"tests.images: filling the wheelhouse for .[{extra}] from pip's cache", flush=True)
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    argv = [sys.executable, "-m", "pip", "download", "--progress-bar=off", "--dest", str(wheels)]
    argv += [f"{ROOT}[{extra}]", *build_requires["requires"]]
    out = run_checked(["nice", "-n", "19", *argv], "pip download", quiet=True)
    kept = {Path(match["path"]).name for match in KEPT.finditer(out)}
    if not kept:
        raise RuntimeError(f"pip download listed no files; its output:\n{out[-3000:]}")
    for stale in wheels.iterdir():
        if stale.is_file() and stale.name not in kept:
            stale.unlink()
    return True


def volumes(config: Path, wheels: Path | None) -> list[str]:
    """``buildah bud`` flags mounting, read-only into every RUN, root's home with pip's
    configuration (written here into ``config``) and the wheelhouse if there is one.

    The configuration also names the host's CA bundle (pip's ``cert``): where HTTPS goes out
    through a TLS-inspecting proxy, the host trusts its CA and the base image does not; the
    bundle is mounted for the build only and never reaches a layer.
    """
    pip_dir = config / PIP_DIR
    pip_dir.mkdir(parents=True, exist_ok=True)
    lines = ["[global]"]
    bundle = os.environ.get("PIP_CERT") or ssl.get_default_verify_paths().cafile
    if bundle and Path(bundle).is_file():
        shutil.copyfile(bundle, pip_dir / "ca-certificates.crt")
        lines.append(f"cert = {MOUNTED_HOME}/{PIP_DIR}/ca-certificates.crt")
    flags = [f"--volume={config}:{MOUNTED_HOME}:ro"]
    if wheels is not None:
        lines += [f"find-links = {MOUNTED_WHEELS}", "no-index = true"]
        flags.append(f"--volume={wheels}:{MOUNTED_WHEELS}:ro")
    (pip_dir / "pip.conf").write_text("\n".join(lines) + "\n")
    return flags
