"""Build the LeaderWorkerSet add-on: the ``sigs.k8s.io/lws`` controller (which also serves its
admission webhooks) and the files it needs next to it.

Same cache and rules as ``build`` (one directory per component and version under
``cache_root()``, complete or absent), but separate from ``ensure_binaries`` so the operator
tests that need no LeaderWorkerSet never wait for it: the ``lws`` fixture and ``python -m
tests.cluster build --lws`` call ``ensure_lws_binaries``.

``lws/<LWS_VERSION>/``: ``lws-controller`` (``cmd`` of the module, built from a throwaway main
module like the others: ``-trimpath``, no cgo, ``nice``), ``crds/`` (its two CRDs) and
``webhook/manifests.yaml`` (its mutating and validating webhook configurations, which
``lws.LwsStack`` points at the local controller).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .build import (
    LWS_VERSION,
    BuildError,
    Log,
    _addon_builder,
    _Builder,
    _component_dir,
    _locked,
    _stderr,
    cache_root,
)

LWS_MODULE = "sigs.k8s.io/lws"
CONTROLLER = "lws-controller"
# The controller watches both kinds (it fails to start without either CRD).
CRD_FILES = (
    "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    "disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
)
WEBHOOKS_FILE = "manifests.yaml"


@dataclass(frozen=True)
class LwsBinaries:
    controller: Path
    crds: tuple[Path, ...]  # in CRD_FILES order
    webhooks: Path  # MutatingWebhookConfiguration + ValidatingWebhookConfiguration, as shipped


def _lws_dir() -> Path:
    return _component_dir("lws", LWS_VERSION)


def find_lws_binaries() -> LwsBinaries | None:
    root = _lws_dir()
    found = LwsBinaries(
        controller=root / CONTROLLER,
        crds=tuple(root / "crds" / name for name in CRD_FILES),
        webhooks=root / "webhook" / WEBHOOKS_FILE,
    )
    if not all(path.is_file() for path in (found.controller, *found.crds, found.webhooks)):
        return None
    return found


def ensure_lws_binaries(log: Log | None = None) -> LwsBinaries:
    """The controller and its files, building what is missing (minutes cold).

    Raises ``GoUnavailable`` without a usable Go, ``BuildError`` when the build fails.
    """
    say: Log = log or _stderr
    found = find_lws_binaries()
    if found is not None:
        return found
    cache_root().mkdir(parents=True, exist_ok=True)
    with _locked(cache_root() / ".build-lws.lock"):
        if find_lws_binaries() is None:
            _build_controller(_addon_builder(["lws"], "--lws", say))
    found = find_lws_binaries()
    if found is None:
        raise BuildError("the LeaderWorkerSet add-on built but is still incomplete; see the log")
    return found


def _build_controller(builder: _Builder) -> None:
    module_dir = Path(builder.infos["lws"]["Dir"])
    files = {f"crds/{name}": module_dir / "config" / "crd" / "bases" / name for name in CRD_FILES}
    files[f"webhook/{WEBHOOKS_FILE}"] = module_dir / "config" / "webhook" / WEBHOOKS_FILE
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise BuildError(f"{LWS_MODULE}@{LWS_VERSION} lacks {', '.join(missing)}")
    version_pkg = f"{LWS_MODULE}/pkg/version"
    builder._build_in_module(
        component="lws",
        version=LWS_VERSION,
        require=f"{LWS_MODULE} {LWS_VERSION}",
        extra_gomod="",
        packages=[f"{LWS_MODULE}/cmd"],
        ldflags=["-s", "-w", f"-X {version_pkg}.GitVersion={LWS_VERSION}"],
        output_name=CONTROLLER,
        extra_files=files,
    )
