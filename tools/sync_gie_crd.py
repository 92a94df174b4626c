"""Copy the InferencePool CRD into the chart from the Gateway API Inference Extension's Go module.

The chart installs ``inferencepools.inference.networking.k8s.io`` (value
``routing.installCRDs``) from ``charts/quire/files/``. That file is never edited by hand: it is
the module's ``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml``, byte for byte,
of the release the operator is built against (``quire_operator.config.GIE_VERSION``), fetched
with ``go mod download`` through the Go module proxy (which verifies it against the checksum
database).

``python tools/sync_gie_crd.py`` writes the chart's copy; ``--check`` writes nothing and exits 1
when the copy differs from the module's file (``tests/operator_tests/test_gie_crd.py`` runs it).
After bumping ``GIE_VERSION``, run it and commit the new copy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE = "sigs.k8s.io/gateway-api-inference-extension"
CRD_IN_MODULE = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
CHART_COPY = ROOT / "charts" / "quire" / "files" / "inferencepools.inference.networking.k8s.io.yaml"


def gie_version() -> str:
    sys.path.insert(0, str(ROOT / "operator"))
    from quire_operator.config import GIE_VERSION

    return GIE_VERSION


def module_crd(version: str) -> bytes:
    """The CRD file of ``MODULE@version``, from the Go module cache (downloaded if missing)."""
    with tempfile.TemporaryDirectory() as work:
        # Outside any module, so no go.mod of the working directory is consulted or changed.
        env = {**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "on"}
        proc = subprocess.run(
            ["go", "mod", "download", "-json", f"{MODULE}@{version}"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(f"go mod download {MODULE}@{version} failed:\n{proc.stdout}{proc.stderr}")
    info = json.loads(proc.stdout)
    return (Path(info["Dir"]) / CRD_IN_MODULE).read_bytes()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = parser.parse_args(argv)
    version = gie_version()
    wanted = module_crd(version)
    current = CHART_COPY.read_bytes() if CHART_COPY.exists() else None
    where = CHART_COPY.relative_to(ROOT)
    if args.check:
        if current != wanted:
            print(f"{where} is not {MODULE}@{version}'s {CRD_IN_MODULE}: run tools/sync_gie_crd.py")
            return 1
        return 0
    CHART_COPY.parent.mkdir(parents=True, exist_ok=True)
    CHART_COPY.write_bytes(wanted)
    print(f"{where}: {MODULE}@{version} {CRD_IN_MODULE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
