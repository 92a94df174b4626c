"""The stand-in for the Dockerfiles' base image, made locally from Debian packages.

Ownership: this module owns the stand-in: which base the Dockerfiles name (read from their
``FROM`` lines, so it cannot drift from them), the Debian packages and fix-ups that make a root
filesystem look like that base where the Dockerfiles depend on it, and the image in the store
tagged with the base's exact name. ``buildah bud --pull=never`` then finds it locally, since the
official ``python`` image cannot be pulled here (no registry is reachable).

What the Dockerfiles need from the base: ``python`` on PATH with ``venv`` and ensurepip, CA
certificates (pip over HTTPS), Python's headers (Triton compiles its launcher against Python.h),
apt-get with the suite's archive configured (the engine installs gcc), and groupadd/useradd.
docs/images.md lists how the stand-in differs from the official image.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.images.host import run_checked
from tests.images.store import Store

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.engine", "Dockerfile.operator")
# python:<major.minor.patch>-slim-<debian suite>, as the Dockerfiles pin it.
BASE_TAG = re.compile(r"^FROM\s+python:(?P<version>(?P<minor>\d+\.\d+)\.\d+)-slim-(?P<suite>\w+)")
# A label on the stand-in: the digest of the recipe below, so a changed recipe rebuilds it.
RECIPE_LABEL = "dev.quire.stand-in.recipe"
# The official image's PATH: /usr/local/bin first, where it installs python; the stand-in links
# python there too.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class BaseImage:
    """The base the Dockerfiles name: ``python:3.11.13-slim-bookworm`` → 3.11, bookworm."""

    version: str  # 3.11.13
    minor: str  # 3.11
    suite: str  # bookworm

    @property
    def reference(self) -> str:
        return f"docker.io/library/python:{self.version}-slim-{self.suite}"

    @property
    def packages(self) -> tuple[str, ...]:
        python = f"python{self.minor}"
        return ("ca-certificates", "netbase", python, f"{python}-venv", f"lib{python}-dev")

    def hooks(self) -> tuple[str, ...]:
        """mmdebstrap customize hooks ($1 is the root): python and python3 on PATH where the
        official image has them. (mmdebstrap itself leaves no package lists or .debs behind,
        as the official slim images ship none.)"""
        python = f"/usr/bin/python{self.minor}"
        return tuple(f'ln -s {python} "$1/usr/local/bin/{name}"' for name in ("python", "python3"))

    def recipe_digest(self) -> str:
        recipe = json.dumps([self.reference, self.packages, self.hooks(), PATH])
        return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def dockerfile_base() -> BaseImage:
    """The one base both Dockerfiles build on (every FROM of both, which must agree)."""
    found = set()
    for name in DOCKERFILES:
        for line in (ROOT / name).read_text().splitlines():
            match = BASE_TAG.match(line)
            if match:
                found.add(BaseImage(match["version"], match["minor"], match["suite"]))
    if len(found) != 1:
        raise ValueError(f"expected one python:X.Y.Z-slim-<suite> base in {DOCKERFILES}: {found}")
    return found.pop()


def ensure_base(store: Store) -> BaseImage:
    """The stand-in in ``store``, made if it is missing or its recipe changed (the caller holds
    the store's lock)."""
    base = dockerfile_base()
    if _recipe_of(store, base.reference) != base.recipe_digest():
        _make(store, base)
    return base


def _make(store: Store, base: BaseImage) -> None:
    print(f"tests.images: making the stand-in for {base.reference} with mmdebstrap", flush=True)
    with tempfile.TemporaryDirectory(prefix="quire-base-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        argv = [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={','.join(base.packages)}",
            *(f"--customize-hook={hook}" for hook in base.hooks()),
            "--skip=output/dev",  # device nodes: the runtime makes /dev, images carry none
            base.suite,
            str(rootfs),
        ]
        run_checked(["nice", "-n", "19", *argv], "mmdebstrap", quiet=False)
        container = store.buildah("from", "scratch").strip()
        try:
            store.buildah("add", container, str(rootfs), "/")
            store.buildah(
                "config",
                f"--env=PATH={PATH}",
                "--env=LANG=C.UTF-8",
                "--cmd=python3",
                f"--label={RECIPE_LABEL}={base.recipe_digest()}",
                container,
            )
            store.buildah("commit", "--rm", container, base.reference)
        except BaseException:
            store.buildah("rm", container)
            raise


def _recipe_of(store: Store, reference: str) -> str | None:
    """The recipe label of the image ``reference`` in the store, None if it is not there."""
    listed = json.loads(store.buildah("images", "--json") or "[]")
    if not any(reference in (image.get("names") or []) for image in listed):
        return None
    inspected = json.loads(store.buildah("inspect", "--type", "image", reference))
    labels = inspected.get("OCIv1", {}).get("config", {}).get("Labels") or {}
    return labels.get(RECIPE_LABEL)
