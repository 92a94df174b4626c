"""The host tools of a daemonless image build, installed from Debian's archive on first use.

Ownership: this module owns the list of Debian packages the image build and the image tests
need and their installation with apt-get; nothing else in tests/images installs anything on the
host. A CI machine starts without them, so the build command installs them itself (it runs as
root there); a person without root installs them once with the command in the error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import NamedTuple


class Tool(NamedTuple):
    command: str  # what must be on PATH
    package: str  # the Debian package that ships it


# buildah builds from the Dockerfiles (chroot isolation, no daemon); skopeo exports what it built;
# umoci unpacks an exported image into a runtime bundle; runc runs that bundle (crun refuses
# hybrid cgroup hierarchies); mmdebstrap makes the base image's root filesystem.
TOOLS = (
    Tool("buildah", "buildah"),
    Tool("skopeo", "skopeo"),
    Tool("umoci", "umoci"),
    Tool("runc", "runc"),
    Tool("mmdebstrap", "mmdebstrap"),
)


class ToolsUnavailable(RuntimeError):
    """The tools are missing and cannot be installed here (not root, or no apt-get)."""


class HostCommandFailed(RuntimeError):
    """A host command (apt-get, buildah, skopeo, ...) failed; the message carries its output."""


def missing_tools() -> list[Tool]:
    return [tool for tool in TOOLS if shutil.which(tool.command) is None]


def ensure_tools() -> None:
    """Install the missing tools with apt-get (refreshing the package lists only if needed)."""
    missing = missing_tools()
    if not missing:
        return
    packages = [tool.package for tool in missing]
    manual = f"apt-get install --no-install-recommends {' '.join(packages)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ToolsUnavailable(f"missing {', '.join(packages)}; as root on Debian: {manual}")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"tests.images: installing {', '.join(packages)} with apt-get", flush=True)
    first = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if first.returncode != 0:
        # A fresh machine may have no package lists yet, or stale ones naming removed versions.
        run_checked(["apt-get", "update"], "apt-get update", env=env)
        run_checked(install, "apt-get install", env=env)
    still = missing_tools()
    if still:
        raise ToolsUnavailable(f"apt-get installed nothing for {[t.command for t in still]}")


def run_checked(
    argv: list[str], what: str, *, env: dict[str, str] | None = None, quiet: bool = True
) -> str:
    """Run ``argv``; its stdout, or ``HostCommandFailed`` with the output's tail.

    ``quiet=False`` lets the command write to our stdout and stderr as it goes (a long build's
    progress), and then only the exit code is checked.
    """
    if not quiet:
        code = subprocess.run(argv, env=env, check=False).returncode
        if code != 0:
            raise HostCommandFailed(f"{what} failed with exit code {code}: {' '.join(argv)}")
        return ""
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise HostCommandFailed(
            f"{what} failed with exit code {proc.returncode}: {' '.join(argv)}\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout
