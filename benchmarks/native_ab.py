"""Compare two builds of the native CPU kernels step by step, inside one engine run.

    python benchmarks/native_ab.py --base REV [--head DIR] [--repeats 1] [-- BENCH FLAGS]

``ab.py`` alternates whole benchmark runs, so on a shared machine a change of a few percent
drowns in the minutes' swings (the same code ran at 166-202 tok/s within an hour here). This
runs Quire's part of ``quire-engine bench throughput`` once (its model, requests and engine;
the flags after ``--``, default ``--preset 32m``), and every native decode step calls both
builds of ``quire_decoder_decode`` in turn, on the same inputs, alternating which goes first:
both face the same seconds of the machine. The builds must give the same bits (it checks every
step's logits): then both write the same K/V to the same slots and the run is the one either
build alone would make. A change that alters results is refused unless ``--rtol`` allows it
(a change of summation order, such as the lane count: every step's logits within rtol times
their largest magnitude); then each step's K/V is the second build's, and the run is one that
either build could make up to rounding, both builds still timed on the same inputs. A change
of the C entry point's signature is refused: compare it with ``ab.py``.

Each build is the library that version's ``cpu/native.py`` compiles (into the shared kernel
cache, through a child process with that version on ``PYTHONPATH``); the engine around them is
this checkout's. The report: per class of step size (sequences in the step), the seconds each
build spent, ``head_vs_base`` (ratio of those sums) and the median of the per-step ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
# Step sizes reported apart: memory-bound (1-4), mixed (5-16) and arithmetic-bound (17-64).
CLASSES = ((1, 1), (2, 4), (5, 16), (17, 32), (33, 64))
# quire_decoder_decode's parameter list (decoder_decode.c) and, since it takes one struct, that
# struct's body (quire_native.h): `prototype` compares both. DecoderStack.decode passes the step's
# sequence count, vocabulary size and logits' address in the struct (`n`, `vocab`, `logits`).
_PROTOTYPE = re.compile(r"int\s+quire_decoder_decode\s*\(([^)]*)\)", re.S)
_ARGS_STRUCT = re.compile(r"struct\s+quire_decoder_args\s*\{([^}]*)\}", re.S)


def _ab() -> Any:
    spec = importlib.util.spec_from_file_location("quire_ab", REPO / "benchmarks" / "ab.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Where native.py and csrc/ live: cpu/ now, kernels/ in checkouts from before the layer folders.
_NATIVE_PKGS = ("cpu", "kernels")


def prototype(root: Path) -> str:
    """The parameter list of ``quire_decoder_decode`` in ``root``'s sources, and the body of
    ``struct quire_decoder_args`` in its header where there is one (comments dropped),
    whitespace folded."""
    # The sources moved from kernels/ to cpu/: a --base from before the move has them there.
    candidates = [root / f"engine/quire_engine/{pkg}/csrc/decoder_decode.c" for pkg in _NATIVE_PKGS]
    path = next(path for path in candidates if path.exists())
    found = _PROTOTYPE.search(path.read_text())
    if found is None:
        raise SystemExit(f"{root}: no quire_decoder_decode in decoder_decode.c")
    parts = [found.group(1)]
    header = path.with_name("quire_native.h")
    struct = _ARGS_STRUCT.search(header.read_text()) if header.exists() else None
    if struct is not None:
        parts.append(re.sub(r"/\*.*?\*/", " ", struct.group(1), flags=re.S))
    return " ".join(" ; ".join(parts).split())


def library_of(root: Path) -> Path:
    """The shared object ``root``'s ``native.py`` builds (or finds in the kernel cache)."""
    pkg = next(p for p in _NATIVE_PKGS if (root / f"engine/quire_engine/{p}/native.py").exists())
    code = f"from quire_engine.{pkg} import native; lib = native.library(); print(lib.path)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root / "engine")},
        capture_output=True,
        text=True,
        check=False,
    )
    path = Path(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None
    if proc.returncode != 0 or path is None or not path.is_file():
        raise SystemExit(f"{root}: the native kernels did not build:\n{proc.stderr[-2000:]}")
    return path


class Paired:
    """Stands in for a ``DecoderStack``'s kernel: calls both builds, in alternating order, and
    records ``(sequences, base seconds, head seconds)`` per step."""

    def __init__(self, base: Any, head: Any, rtol: float = 0.0) -> None:
        self.base, self.head, self.rtol = base, head, rtol
        self.steps: list[tuple[int, float, float]] = []
        self._head_first = True

    def __call__(self, args: Any) -> None:  # a native.DecoderArgs
        n, vocab, logits_at = int(args.n), int(args.vocab), int(args.logits)
        # The logits are written in place: keep the first build's and compare with the second's.
        pointer = ctypes.cast(logits_at, ctypes.POINTER(ctypes.c_float))
        out = torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(n, vocab)))
        order = (self.head, self.base) if self._head_first else (self.base, self.head)
        self._head_first = not self._head_first
        took: dict[int, float] = {}
        first: torch.Tensor | None = None
        for kernel in order:
            start = time.perf_counter()
            kernel(args)
            took[id(kernel)] = time.perf_counter() - start
            if first is None:
                first = out.clone()
        if first is None or not (
            torch.equal(first, out) or (first - out).abs().max() <= self.rtol * first.abs().max()
        ):
            raise SystemExit(
                "the two builds gave different logits (beyond --rtol): compare them with ab.py"
            )
        self.steps.append((n, took[id(self.base)], took[id(self.head)]))


def _summary(rows: list[tuple[float, float]]) -> dict[str, Any]:
    base_s, head_s = sum(b for b, _ in rows), sum(h for _, h in rows)
    return {
        "steps": len(rows),
        "base_s": round(base_s, 4),
        "head_s": round(head_s, 4),
        "head_vs_base": round(head_s / base_s, 3) if base_s else None,
        "median_step_ratio": round(statistics.median(h / b for b, h in rows if b), 3),
    }


def report(steps: list[tuple[int, float, float]]) -> dict[str, Any]:
    """Per class of step size that has steps (``"1"``, ``"2-4"``, ...), and ``"all"``."""
    out: dict[str, Any] = {}
    for lo, hi in CLASSES:
        rows = [(b, h) for n, b, h in steps if lo <= n <= hi]
        if rows:
            out[f"{lo}" if lo == hi else f"{lo}-{hi}"] = _summary(rows)
    if steps:
        out["all"] = _summary([(b, h) for _, b, h in steps])
    return out


def run(args: argparse.Namespace, base_lib: Path, head_lib: Path) -> dict[str, Any]:
    from quire_engine.bench import throughput
    from quire_engine.cpu import native

    bench = throughput.parse(args.workload)
    if bench.device != "cpu":
        raise SystemExit("the native kernels run on CPU only")
    lengths, prompts = throughput.workload(bench)
    model = throughput.bench_model(bench)

    def load(path: Path) -> Any:
        return native.DecoderDecode(native.Library(ctypes.CDLL(str(path)), path, ()))

    paired = Paired(load(base_lib), load(head_lib), args.rtol)
    with tempfile.TemporaryDirectory() as tmp:
        llm = throughput.quire_llm(model, Path(tmp), bench.budget_seqs * bench.max_model_len, bench)
        stack = llm.engine.runner.decoder
        if stack is None:
            raise SystemExit("the native decoder is off here (no compiler, or turned off)")
        stack.kernel = paired  # type: ignore[assignment]  # the same call, timed twice
        for _ in range(args.repeats):
            llm.generate(prompts, throughput.request_params(lengths))
        if llm.engine.runner.decoder is not stack:
            raise SystemExit("the native decoder was rebuilt mid-run: the pairing was lost")
    return {"base_library": base_lib.name, "head_library": head_lib.name, **report(paired.steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ab = _ab()
    ab.add_revisions(parser)
    parser.add_argument("--repeats", type=int, default=1, help="runs of the workload")
    parser.add_argument(
        "--rtol",
        type=float,
        default=0.0,
        help="logits may differ by this times their largest magnitude (default 0: same bits)",
    )
    parser.add_argument(
        "workload",
        nargs=argparse.REMAINDER,
        help="-- then `bench throughput` flags for the workload (default: --preset 32m)",
    )
    args = parser.parse_args(argv)
    args.workload = (args.workload[1:] if args.workload[:1] == ["--"] else args.workload) or [
        "--preset",
        "32m",
    ]
    if args.repeats < 1 or not args.rtol >= 0:
        parser.error("--repeats must be >= 1 and --rtol >= 0")
    head_root = args.head.resolve()
    with tempfile.TemporaryDirectory(prefix="quire-native-ab-") as tmp:
        base_root = ab.export(args.base, Path(tmp))
        if not prototype(base_root) == prototype(head_root) == prototype(REPO):
            raise SystemExit(
                "quire_decoder_decode's parameters differ between the builds (or from this "
                "checkout, whose engine calls them): compare them with ab.py"
            )
        base_lib, head_lib = library_of(base_root), library_of(head_root)
    result = {"base": args.base, "head": str(head_root), **run(args, base_lib, head_lib)}
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
