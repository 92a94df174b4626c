"""``build_image(kind)``: one image built from its Dockerfile with buildah, then exported.

Ownership: this module owns the build of ``Dockerfile.operator`` and ``Dockerfile.engine`` as
they are (``buildah bud``, chroot isolation, no daemon), the images' names and tags (the chart's
defaults: ``quire-operator`` and ``quire-engine`` at the chart's appVersion), and the exported
files a person pushes or loads: an OCI layout and a docker-archive tarball per image.

Caching: the store keeps every layer (``--layers``), so a warm build re-runs only the steps whose
inputs changed; the build stage is tagged too (``quire-<kind>-build``), which keeps its last
layers out of the pruning that drops the previous build's images. An export is redone only when
the image changed (its id is written next to the files).
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tests.images import wheelhouse
from tests.images.base import ensure_base
from tests.images.host import ensure_tools
from tests.images.store import Store

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "quire" / "Chart.yaml"


class ImageKind(Enum):
    OPERATOR = "operator"
    ENGINE = "engine"

    @property
    def dockerfile(self) -> Path:
        return ROOT / f"Dockerfile.{self.value}"

    @property
    def repository(self) -> str:
        """The image's name, as the chart's ``image.repository``/``engineImage.repository``."""
        return f"quire-{self.value}"

    @property
    def extra(self) -> str:
        """The pyproject extra the Dockerfile installs."""
        return self.value

    @property
    def disk_gb(self) -> float:
        """Free disk a build may need at its peak: when the engine's final stage cannot take
        ``COPY --from=build`` from the cache, it copies the 6 GB ``/opt/quire`` into a container
        and commits it (about twice that while it runs); the export then rewrites 10 GB."""
        return 14.0 if self is ImageKind.ENGINE else 2.0


def app_version() -> str:
    """The chart's appVersion: the tag the chart deploys by default, so the tag we build."""
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', CHART.read_text(), re.M)
    if match is None:
        raise ValueError(f"{CHART} has no appVersion")
    return match.group(1)


@dataclass(frozen=True)
class BuiltImage:
    kind: ImageKind
    version: str
    image_id: str
    oci_layout: Path  # an OCI image layout directory; the image's ref name is ``version``
    archive: Path  # a docker-archive tarball (``docker load -i``), tagged ``tag``
    build_s: float
    export_s: float

    @property
    def tag(self) -> str:
        return f"{self.kind.repository}:{self.version}"

    @property
    def oci_reference(self) -> str:
        """skopeo's name for the image in the OCI layout (``skopeo copy <this> docker://...``)."""
        return f"oci:{self.oci_layout}:{self.version}"


def build_image(kind: ImageKind, out: Path | None = None, store: Store | None = None) -> BuiltImage:
    """Build ``kind`` from its Dockerfile (installing the host tools first if needed) and export
    it to ``out`` (default: the store's ``out/``)."""
    ensure_tools()
    store = store or Store.default()
    out = out or store.out
    version = app_version()
    local = f"localhost/{kind.repository}:{version}"
    with store.locked():
        started = time.monotonic()
        base = ensure_base(store)
        wheels = store.wheels(kind.value)
        filled = wheelhouse.fill(kind.extra, wheels, base.minor)
        mounts = wheelhouse.volumes(store.pip_config(kind.value), wheels if filled else None)
        store.require_free(kind.disk_gb, f"building {local}")
        stage = f"localhost/{kind.repository}-build:{version}"
        _bud(store, kind, mounts, "--target=build", f"--tag={stage}")
        _bud(store, kind, mounts, f"--tag={local}")
        inspect = ("inspect", "--type", "image", "--format", "{{.FromImageID}}", local)
        image_id = store.buildah(*inspect)
        # The previous build's images, now nameless and without children; named ones stay.
        store.buildah("rmi", "--prune")
        built = time.monotonic()
        oci, archive = _export(store, kind, local, image_id.strip(), out, version)
        exported = time.monotonic()
    return BuiltImage(
        kind, version, image_id.strip(), oci, archive, built - started, exported - built
    )


def _bud(store: Store, kind: ImageKind, mounts: list[str], *flags: str) -> None:
    store.buildah(
        "bud",
        "--isolation=chroot",
        "--layers",
        "--pull=never",  # the base is the local stand-in (base.py)
        "--force-rm",  # no leftover containers from a failed step
        f"--file={kind.dockerfile}",
        *mounts,
        *flags,
        str(ROOT),
        quiet=False,
    )


def _export(
    store: Store, kind: ImageKind, local: str, image_id: str, out: Path, version: str
) -> tuple[Path, Path]:
    """The OCI layout and the docker-archive of ``local`` under ``out``, redone only when the
    image id differs from the one the last export recorded."""
    stem = f"{kind.repository}-{version}"
    oci, archive, marker = out / f"{stem}.oci", out / f"{stem}.tar", out / f"{stem}.id"
    if oci.is_dir() and archive.is_file() and marker.is_file() and marker.read_text() == image_id:
        return oci, archive
    out.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    for stale in (archive, oci):
        if stale.is_dir():
            shutil.rmtree(stale)
        stale.unlink(missing_ok=True)
    print(f"tests.images: exporting {local} to {oci} and {archive}", flush=True)
    store.skopeo("copy", f"containers-storage:{local}", f"oci:{oci}:{version}")
    tag = f"{kind.repository}:{version}"
    store.skopeo("copy", f"containers-storage:{local}", f"docker-archive:{archive}:{tag}")
    marker.write_text(image_id)
    return oci, archive
