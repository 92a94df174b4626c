"""``python -m tests.images``: build the images for a person at a shell.

    python -m tests.images build operator|engine|all [--out DIR]
    python -m tests.images paths

``build`` installs the Debian tools it needs (as root), builds from the Dockerfiles and writes,
per image, an OCI layout and a docker-archive tarball (default: ~/.cache/quire/images/out), then
prints how to load or push them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.images.build import BuiltImage, ImageKind, app_version, build_image
from tests.images.store import Store


def _report(image: BuiltImage) -> str:
    return (
        f"{image.tag}: built in {image.build_s:.0f} s, exported in {image.export_s:.0f} s\n"
        f"  docker-archive: {image.archive} ({image.archive.stat().st_size / 1e6:.0f} MB)\n"
        f"    docker load -i {image.archive}\n"
        f"  OCI layout:     {image.oci_layout}\n"
        f"    skopeo copy {image.oci_reference} docker://$REGISTRY/{image.tag}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.images", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build from the Dockerfiles and export")
    build.add_argument("kind", choices=[*(k.value for k in ImageKind), "all"])
    build.add_argument("--out", type=Path, help="where the archives go")
    commands.add_parser("paths", help="where the exported images are (builds nothing)")
    args = parser.parse_args(argv)
    store = Store.default()
    if args.command == "paths":
        for kind in ImageKind:
            stem = store.out / f"{kind.repository}-{app_version()}"
            for path in (stem.with_suffix(".oci"), stem.with_suffix(".tar")):
                print(f"{path}{'' if path.exists() else ' (not built)'}")
        return 0
    kinds = list(ImageKind) if args.kind == "all" else [ImageKind(args.kind)]
    for kind in kinds:
        print(_report(build_image(kind, out=args.out, store=store)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
