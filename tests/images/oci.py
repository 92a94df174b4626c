"""An exported OCI image layout read back: the image's config and its layers' sizes.

Ownership: read-only access to a layout ``build.py`` wrote (``index.json`` → manifest →
config and layer blobs), so the tests check the file a user pushes, not buildah's own view.
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Layer:
    digest: str
    compressed_bytes: int  # as stored in the layout and pushed to a registry


@dataclass(frozen=True)
class Layout:
    path: Path

    def _blob(self, digest: str) -> Path:
        algorithm, _, value = digest.partition(":")
        return self.path / "blobs" / algorithm / value

    def _json(self, digest: str) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self._blob(digest).read_text())
        return loaded

    def manifest(self) -> dict[str, Any]:
        index = json.loads((self.path / "index.json").read_text())
        (descriptor,) = index["manifests"]  # build.py writes one image per layout
        return self._json(descriptor["digest"])

    def config(self) -> dict[str, Any]:
        """The image config's ``config`` part: Entrypoint, User, Env, ExposedPorts, ..."""
        loaded: dict[str, Any] = self._json(self.manifest()["config"]["digest"])["config"]
        return loaded

    def layers(self) -> list[Layer]:
        return [Layer(d["digest"], int(d["size"])) for d in self.manifest()["layers"]]


def archive_layer_sizes(archive: Path) -> list[int]:
    """The uncompressed size of each layer in a docker-archive tarball, in image order."""
    with tarfile.open(archive) as tar:
        manifest = tar.extractfile("manifest.json")
        assert manifest is not None
        (image,) = json.loads(manifest.read())
        return [tar.getmember(layer).size for layer in image["Layers"]]
