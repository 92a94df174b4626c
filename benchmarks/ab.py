"""Compare two versions of the engine on one benchmark, in the same minutes.

    python benchmarks/ab.py --base 2ecf7a2 [--head WORKTREE] [--runs 6] -- \
        bench step --json --running 256 --steps 60

The base revision is exported (``git archive``) into a temporary directory; the head is this
checkout (or ``--head``). The benchmark command runs ``--runs`` times for each, alternating base
and head, each as ``python -m quire_engine.cli ...`` with ``PYTHONPATH`` pointing at that
version's ``engine/``. Every numeric leaf of the benchmarks' JSON (or those whose key contains
``--key``) is reported with each version's runs, their best (minimum for times, maximum for
rates: keys containing ``tok_s`` or the word ``per``, ``throughput`` or ``ratio``; times
such as ``median_s`` are not) and their median, and ``head_vs_base`` = head best / base best.

Why best-of-N: on a shared machine, other tenants only ever add time, and they do so for
seconds at a time, so a single pair of runs can disagree by 2-3x in either direction;
alternating runs and keeping each version's best compares the code, not the neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted.key, number)`` for every numeric leaf (bools excluded)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield prefix, float(value)


RATE_WORDS = frozenset({"per", "throughput", "ratio"})  # whole words of a rate's key


def higher_is_better(key: str) -> bool:
    """Rates (``quire_tok_s``, ``output_tokens_per_cpu_s``, ``ratio_vs_offline``) are better
    higher; times (``median_s``, ``duration_s``, ``step_us_p50``), sizes and counts lower."""
    last = key.rsplit(".", 1)[-1]
    return "tok_s" in last or not RATE_WORDS.isdisjoint(last.split("_"))


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (any git revision) as files under ``into``."""
    archive = into / "base.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), rev], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into / "base", filter="data")
    return into / "base"


def add_revisions(parser: argparse.ArgumentParser) -> None:
    """``--base`` (a git revision) and ``--head`` (a checkout), shared with instructions.py."""
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument(
        "--head", type=Path, default=REPO, help="checkout to measure (default: this)"
    )


def run_once(root: Path, command: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(root / "engine"))
    proc = subprocess.run(
        [sys.executable, "-m", "quire_engine.cli", *command],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{root}: {' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{root}: no JSON line in the output of {' '.join(command)}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def summarize(runs: list[dict[str, Any]], key_filter: str | None) -> dict[str, dict[str, Any]]:
    values: dict[str, list[float]] = {}
    for run in runs:
        for key, number in leaves(run):
            if key_filter is None or key_filter in key:
                values.setdefault(key, []).append(number)
    out: dict[str, dict[str, Any]] = {}
    for key, nums in values.items():
        best = max(nums) if higher_is_better(key) else min(nums)
        out[key] = {"best": best, "median": statistics.median(nums), "runs": nums}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_revisions(parser)
    parser.add_argument("--runs", type=int, default=6, help="runs per version (alternating)")
    parser.add_argument("--key", default=None, help="report only keys containing this")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark command after --, e.g. -- bench step --json")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    with tempfile.TemporaryDirectory(prefix="quire-ab-") as tmp:
        base_root = export(args.base, Path(tmp))
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
        for _ in range(args.runs):
            runs["base"].append(run_once(base_root, command))
            runs["head"].append(run_once(args.head.resolve(), command))
    base = summarize(runs["base"], args.key)
    head = summarize(runs["head"], args.key)
    report: dict[str, Any] = {"base": args.base, "command": command, "runs": args.runs}
    for key in base.keys() & head.keys():
        b, h = base[key], head[key]
        ratio = h["best"] / b["best"] if b["best"] else None
        report[key] = {
            "base": b,
            "head": h,
            "head_vs_base": round(ratio, 3) if ratio is not None else None,
        }
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
