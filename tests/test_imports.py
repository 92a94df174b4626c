"""The import rules between the engine's layers and the operator's (``[tool.importlinter]`` in
pyproject.toml), run with import-linter; and proof that each kind of contract fails on a
violating import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The `lint-imports` console script, run by this interpreter (the package has no __main__).
_LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the packages under ``root`` with ``root``'s pyproject.toml."""
    return subprocess.run(
        [sys.executable, "-c", _LINT_IMPORTS, "pyproject.toml", "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": f"{root / 'engine'}:{root / 'operator'}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_the_import_contracts_hold() -> None:
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("core/block_pool.py", "import torch", "The core is pure Python"),
        (
            "server/app.py",
            "from quire_engine.bench import workload",
            "Nothing in the serving path imports the benchmarks",
        ),
        ("server/protocol.py", "from quire_engine.model import sampler", "The server reaches"),
        ("cpu/linear.py", "from quire_engine.core import config", "Kernels and the CPU backend"),
        ("core/sequence.py", "from quire_engine.engine import metrics", "Engine layers"),
        ("core/sequence.py", "from quire_engine.core import scheduler", "No import cycles"),
        # Paths under quire_operator/ inject into the operator's tree.
        (
            "quire_operator/builders/deployment.py",
            "from quire_operator.children import Children",
            "Operator layers",
        ),
        (
            "quire_operator/spec/view.py",
            "from quire_operator.status import conditions",
            "Operator layers",
        ),
    ],
)
def test_a_violating_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for package in ("engine", "operator"):
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    operator = module.startswith("quire_operator/")
    target = (
        tmp_path / "operator" / module
        if operator
        else tmp_path / "engine" / "quire_engine" / module
    )
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = [row for row in proc.stdout.splitlines() if row.endswith(" BROKEN")]
    assert any(row.startswith(contract) for row in broken), proc.stdout
