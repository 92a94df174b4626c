"""Fixtures of the image tests: each image built once per session (cached across sessions in
~/.cache/quire/images) and unpacked once per session for runc.

Policy, as for the test cluster: a machine that cannot get the build tools (not root, no
apt-get) skips these tests with the reason locally and fails them under ``CI=true``. A build
that fails (a Dockerfile bug) always fails.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.cluster.pytest_plugin import unavailable
from tests.images.build import BuiltImage, ImageKind, build_image
from tests.images.container import Bundle
from tests.images.host import ToolsUnavailable


def _built(request: pytest.FixtureRequest, kind: ImageKind) -> BuiltImage:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # A cold build takes many minutes; show buildah's steps instead of a silent hang.
    show = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with show:
            image = build_image(kind)
            print(
                f"\n{image.tag}: built in {image.build_s:.0f} s, exported in {image.export_s:.0f} s"
            )
            return image
    except ToolsUnavailable as err:
        unavailable(str(err))


@pytest.fixture(scope="session")
def operator_image(request: pytest.FixtureRequest) -> BuiltImage:
    return _built(request, ImageKind.OPERATOR)


@pytest.fixture(scope="session")
def engine_image(request: pytest.FixtureRequest) -> BuiltImage:
    return _built(request, ImageKind.ENGINE)


@pytest.fixture(scope="session")
def operator_bundle(operator_image: BuiltImage, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return Bundle.unpack(operator_image, tmp_path_factory.mktemp("operator") / "bundle")


@pytest.fixture(scope="session")
def engine_bundle(engine_image: BuiltImage, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return Bundle.unpack(engine_image, tmp_path_factory.mktemp("engine") / "bundle")
