"""The image cache tree and the commands that use it: buildah's storage, kept between runs.

Ownership: this module owns ``$QUIRE_CACHE_DIR/images`` (default ``~/.cache/quire/images``):

- ``storage/``: buildah's container storage (overlay), a private one rather than the host's
  ``/var/lib/containers``: it holds the stand-in base, the layers ``buildah bud --layers``
  reuses, and the built images, so a warm build re-runs only the steps whose inputs changed;
- ``wheels/<kind>/`` and ``pip/<kind>/``: the wheelhouse and the build's pip configuration
  (``wheelhouse.py``);
- ``out/``: the exported images (``build.py``), unless the caller names another directory;
- ``build.lock``: one build at a time on this store.

Every buildah and skopeo command goes through ``Store.buildah``/``Store.skopeo``, which point
them at this storage with ``CONTAINERS_STORAGE_CONF``; the runtime state (mounts, locks) lives
under ``/run`` (tmpfs), so a reboot cannot leave stale mounts in the cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.build import cache_root
from tests.images.host import run_checked

RUN_ROOT = Path("/run/quire-images")


@dataclass(frozen=True)
class Store:
    root: Path

    @classmethod
    def default(cls) -> Store:
        return cls(cache_root() / "images")

    @property
    def graph_root(self) -> Path:
        return self.root / "storage"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def wheels(self, kind: str) -> Path:
        return self.root / "wheels" / kind

    def pip_config(self, kind: str) -> Path:
        return self.root / "pip" / kind

    @property
    def storage_conf(self) -> Path:
        return self.root / "storage.conf"

    def env(self) -> dict[str, str]:
        """Our environment plus ``CONTAINERS_STORAGE_CONF`` naming this storage."""
        self.root.mkdir(parents=True, exist_ok=True)
        conf = (
            "[storage]\n"
            'driver = "overlay"\n'
            f'graphroot = "{self.graph_root}"\n'
            f'runroot = "{RUN_ROOT}"\n'
        )
        if not self.storage_conf.exists() or self.storage_conf.read_text() != conf:
            self.storage_conf.write_text(conf)
        return {**os.environ, "CONTAINERS_STORAGE_CONF": str(self.storage_conf)}

    def buildah(self, *args: str, quiet: bool = True) -> str:
        """``buildah`` on this storage; ``quiet=False`` shows its output as it goes and runs it
        at the lowest CPU priority (a build: the machine is shared with tests)."""
        argv = ["buildah", *args] if quiet else ["nice", "-n", "19", "buildah", *args]
        return run_checked(argv, f"buildah {args[0]}", env=self.env(), quiet=quiet)

    def skopeo(self, *args: str) -> str:
        return run_checked(["skopeo", *args], f"skopeo {args[0]}", env=self.env())

    def require_free(self, need_gb: float, what: str) -> None:
        """Refuse a build that would fill the disk halfway through (buildah then fails with a
        bare exit code 125 and the reason only in its own output), with the numbers."""
        self.root.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(self.root).free / 1e9
        if free_gb < need_gb:
            raise OSError(
                f"{what} needs about {need_gb:.0f} GB free under {self.root}; there are "
                f"{free_gb:.1f} GB (removing {self.out} drops the last exports)"
            )

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock: a second build (another pytest, a person) waits for ours.
        One lock for all: a build's pruning would otherwise remove another build's unnamed
        intermediate images while it still makes them."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "build.lock").open("w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
