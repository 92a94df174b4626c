"""What each built image says about itself matches its Dockerfile, and holds what it should.

Read from the exported OCI layout (the file a user pushes) and from umoci's unpacking of it: the
entrypoint, user, environment and exposed port as the Dockerfile's final stage declares them; no
build toolchain (and no torch) in the operator image, gcc in the engine's; nothing the build
mounted (the wheelhouse, its pip.conf) left in either. The engine's size and layer sizes go to
the test output, since a grown image is worth seeing in every CI log.
"""

from __future__ import annotations

import re

import pytest

from tests.images.base import PATH
from tests.images.build import BuiltImage
from tests.images.container import Bundle
from tests.images.oci import Layout, archive_layer_sizes
from tests.images.wheelhouse import MOUNTED_HOME, MOUNTED_WHEELS
from tests.operator_tests.test_dockerfiles import exec_form, final_stage, one

pytestmark = pytest.mark.slow

# What a build toolchain would put on PATH; the operator image needs none of it.
TOOLCHAIN = ("gcc", "cc", "c++", "g++", "make", "ld", "as", "cpp")


def declared_env(dockerfile: str) -> dict[str, str]:
    """The final stage's ENV values, ``$PATH`` expanded with the base image's PATH."""
    env: dict[str, str] = {}
    for instruction in final_stage(dockerfile):
        if instruction.keyword == "ENV":
            for pair in instruction.args.split():
                key, _, value = pair.partition("=")
                env[key] = value.replace("$PATH", PATH)
    return env


def check_config(image: BuiltImage) -> None:
    dockerfile = image.kind.dockerfile.name
    config = Layout(image.oci_layout).config()
    assert config["Entrypoint"] == exec_form(one(dockerfile, "ENTRYPOINT").args)
    assert config["User"] == one(dockerfile, "USER").args
    env = dict(entry.split("=", 1) for entry in config["Env"])
    for key, value in declared_env(dockerfile).items():
        assert env.get(key) == value, f"{image.tag}: {key}={env.get(key)!r}, declared {value!r}"
    exposed = [f"{port}/tcp" for port in one(dockerfile, "EXPOSE").args.split()]
    assert sorted(config["ExposedPorts"]) == exposed


def check_no_build_mounts(bundle: Bundle) -> None:
    """The build mounted the wheelhouse and pip's configuration over directories of the base;
    nothing of either is left in them."""
    assert not list((bundle.rootfs / MOUNTED_WHEELS.lstrip("/")).iterdir())
    home = bundle.rootfs / MOUNTED_HOME.lstrip("/")
    assert sorted(p.name for p in home.iterdir()) == [".bashrc", ".profile"]


def test_operator_image_is_what_its_dockerfile_says(
    operator_image: BuiltImage, operator_bundle: Bundle
) -> None:
    check_config(operator_image)
    check_no_build_mounts(operator_bundle)
    rootfs = operator_bundle.rootfs
    found = [
        f"{d}/{tool}"
        for d in ("usr/bin", "usr/local/bin", "bin")
        for tool in TOOLCHAIN
        if (rootfs / d / tool).exists()
    ]
    assert not found, f"build toolchain in the operator image: {found}"
    assert not (rootfs / "usr/lib/gcc").exists()
    site = list((rootfs / "opt/quire/lib").glob("python3.*/site-packages"))
    assert len(site) == 1, site
    assert (site[0] / "quire_operator").is_dir() and (site[0] / "kopf").is_dir()
    assert not (site[0] / "torch").exists() and not (site[0] / "quire_engine").exists()


def test_engine_image_is_what_its_dockerfile_says(
    engine_image: BuiltImage, engine_bundle: Bundle, capsys: pytest.CaptureFixture[str]
) -> None:
    check_config(engine_image)
    check_no_build_mounts(engine_bundle)
    rootfs = engine_bundle.rootfs
    assert (rootfs / "usr/bin/gcc").exists(), "gcc: Triton and the native CPU kernels need it"
    assert list(rootfs.glob("usr/include/python3.*/Python.h")), "Triton compiles against Python.h"
    site = list((rootfs / "opt/quire/lib").glob("python3.*/site-packages"))
    assert len(site) == 1 and (site[0] / "quire_engine").is_dir() and (site[0] / "torch").is_dir()

    layers = Layout(engine_image.oci_layout).layers()
    uncompressed = archive_layer_sizes(engine_image.archive)
    assert len(layers) == len(uncompressed) >= 2
    with capsys.disabled():
        print(
            f"\n{engine_image.tag}: {sum(uncompressed) / 1e9:.2f} GB uncompressed, "
            f"{sum(layer.compressed_bytes for layer in layers) / 1e9:.2f} GB compressed, "
            f"docker-archive {engine_image.archive.stat().st_size / 1e9:.2f} GB"
        )
        for number, (layer, size) in enumerate(zip(layers, uncompressed, strict=True)):
            short = re.sub(r"^sha256:", "", layer.digest)[:12]
            print(
                f"  layer {number} {short}: {size / 1e6:9.1f} MB "
                f"({layer.compressed_bytes / 1e6:.1f} MB compressed)"
            )
