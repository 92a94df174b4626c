"""Repository-wide checks: lint, format, types, layout, and that CI runs the README's command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_lint_clean() -> None:
    proc = run(str(BIN / "ruff"), "check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_clean() -> None:
    proc = run(str(BIN / "ruff"), "format", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_clean() -> None:
    proc = run(str(BIN / "mypy"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2, "README must start with the run and the test command"
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
    assert "CI=true" in ci


def test_layout_never_shadows_stdlib_operator() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert not (ROOT / "tests" / "operator").exists()
    assert not (ROOT / "engine" / "__init__.py").exists()
    for name in ("Dockerfile.engine", "Dockerfile.operator", "pyproject.toml", "README.md"):
        assert (ROOT / name).is_file(), name
    for name in ("engine", "operator", "charts", "crds", "tests"):
        assert (ROOT / name).is_dir(), name
