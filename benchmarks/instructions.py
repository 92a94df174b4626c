"""Instructions per engine step, base vs head, counted by valgrind: deterministic where time is
not.

    python benchmarks/instructions.py --base <rev> [--running 256] [--steps 100]

Each version runs ``quire-engine bench step --running R --steps 5`` and ``--steps 5+S`` under
``valgrind --tool=cachegrind --cache-sim=no``; the difference of the two instruction totals over
``S`` is what one decode step executes (imports, loading and the prefill cancel out). On a
shared machine, time per step swings two- or threefold while instruction counts repeat to a
fraction of a percent, so a change of a few percent in per-step work is visible here and not in
``ab.py``. Instructions are not time (a cache miss costs more than an add), so a change is
confirmed in time too. The base revision is exported as in ``ab.py``; runs go two at a time.
Needs valgrind (``apt-get install valgrind``); about three minutes per pair of runs on a small
machine (importing torch under valgrind dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import add_revisions, export

WARM_STEPS = 5
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def parse_refs(stderr: str) -> int:
    """The ``I refs`` total of a cachegrind run's summary."""
    match = _REFS.search(stderr)
    if match is None:
        raise ValueError(f"no 'I refs' line in valgrind's output:\n{stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def per_step(short: int, long: int, steps: int) -> float:
    """Instructions of one step from totals of runs ``steps`` steps apart."""
    if long <= short:
        raise ValueError(f"the longer run counted {long} <= {short} instructions")
    return (long - short) / steps


def count(root: Path, running: int, steps: int) -> int:
    """Instructions of ``bench step`` at ``running`` sequences for ``steps`` steps."""
    command = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, "-m", "quire_engine.cli", "bench", "step", "--json",
        "--running", str(running), "--steps", str(steps),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root / "engine"))
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{root}: {' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    return parse_refs(proc.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_revisions(parser)
    parser.add_argument("--running", type=int, default=256, help="running sequences")
    parser.add_argument("--steps", type=int, default=100, help="decode steps counted")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.running < 1:
        parser.error("--steps and --running must be >= 1")
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="quire-ir-") as tmp:
        roots = {"base": export(args.base, Path(tmp)), "head": args.head.resolve()}
        jobs = [(name, n) for name in roots for n in (WARM_STEPS, WARM_STEPS + args.steps)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            totals = dict(
                zip(
                    jobs,
                    pool.map(lambda job: count(roots[job[0]], args.running, job[1]), jobs),
                    strict=True,
                )
            )
    result = {
        name: round(per_step(totals[name, WARM_STEPS], totals[name, WARM_STEPS + args.steps],
                             args.steps))
        for name in roots
    }  # fmt: skip
    report = {
        "base": args.base,
        "running": args.running,
        "steps": args.steps,
        "instructions_per_step": result,
        "head_vs_base": round(result["head"] / result["base"], 4),
    }
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
