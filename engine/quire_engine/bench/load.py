"""Loading a safetensors checkpoint onto the device, by loader: time and peak resident memory.

Loaders (each builds the whole model on ``--device`` as ``--dtype``):

* ``transformers``: ``AutoModelForCausalLM.from_pretrained`` on the CPU, then the model moved to
  the device (how the engine loaded every checkpoint before it read safetensors itself).
* ``direct``: the engine's loader (``weights.load_whole``): the weightless model, filled tensor by
  tensor from the memory-mapped files, each going to the device and dtype in one step.
* ``fastsafetensors`` and ``runai`` (when installed): the same weightless model filled from the
  tensors those libraries read (``fastsafe_open`` without GPUDirect; ``SafetensorsStreamer``).

Each load runs in a fresh process (the page cache stays warm: the file is read once before the
first timed load, so every loader reads it from memory), alternating loaders within each
repeat. A child reports the wall seconds of the load and its resident-memory high-water mark
over the load (``VmHWM`` reset through ``/proc/self/clear_refs`` just before, minus the resident
memory then); file pages of the mapped checkpoint count while mapped. The checkpoint is a
benchmark Llama with random weights (``--preset``) unless ``--model`` names one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LOADERS = ("transformers", "direct", "fastsafetensors", "runai")
# Benchmark Llamas (bench throughput's shape): 32.5M and 267M parameters.
PRESETS: dict[str, dict[str, int]] = {
    "32m": {"hidden": 512, "layers": 9, "vocab": 4096, "max_model_len": 1024, "seed": 0},
    "270m": {"hidden": 1024, "layers": 16, "vocab": 32000, "max_model_len": 1024, "seed": 0},
}
_CHILD = "import sys; from quire_engine.bench.load import child; child(*sys.argv[1:])"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="32m",
        help="the benchmark Llama to build and load (32m: 124 MiB in float32; 270m: 1 GiB)",
    )
    parser.add_argument("--model", default=None, help="a checkpoint directory instead")
    parser.add_argument("--loaders", default=",".join(LOADERS), help="comma-separated subset")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from quire_engine.bench import peers

    loaders = [name for name in args.loaders.split(",") if name]
    if not loaders or set(loaders) - set(LOADERS):
        raise ValueError(f"--loaders: choose from {', '.join(LOADERS)}; got {args.loaders!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; got {args.repeats}")
    missing = [name for name in loaders if name in ("fastsafetensors", "runai") and not _has(name)]
    loaders = [name for name in loaders if name not in missing]
    with tempfile.TemporaryDirectory(prefix="quire-bench-load-") as tmp:
        path = Path(args.model) if args.model else None
        if path is None:
            path = peers.build_model_dir(Path(tmp) / args.preset, **PRESETS[args.preset])
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        for file in path.glob("*.safetensors"):  # into the page cache, for every loader alike
            file.read_bytes()
        results: dict[str, Any] = {}
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in loaders}
            for _ in range(args.repeats):
                for name in loaders:
                    runs[name].append(_spawn(name, path, dtype, args.device))
            results[dtype] = {name: _summary(r) for name, r in runs.items()}
            if "transformers" in runs and "direct" in runs:
                results[dtype]["direct_vs_transformers"] = _ratios(
                    runs["direct"], runs["transformers"]
                )
    return {
        "model": args.model or args.preset,
        "checkpoint_mib": round(size / 2**20, 1),
        "device": args.device,
        "repeats": args.repeats,
        "not_installed": missing,
        "dtypes": results,
    }


def _has(loader: str) -> bool:
    import importlib.util

    module = "fastsafetensors" if loader == "fastsafetensors" else "runai_model_streamer"
    return importlib.util.find_spec(module) is not None


def _spawn(loader: str, path: Path, dtype: str, device: str) -> dict[str, float]:
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": package_root}
    argv = [sys.executable, "-c", _CHILD, loader, str(path), dtype, device]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise ValueError(f"loader {loader} failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(r["seconds"] for r in runs), 3),
        "min_s": round(min(r["seconds"] for r in runs), 3),
        "median_peak_mib": round(statistics.median(r["peak_mib"] for r in runs), 1),
    }


def _ratios(new: list[dict[str, float]], old: list[dict[str, float]]) -> dict[str, float]:
    """Medians of the per-repeat ratios new / old (the two ran back to back in each repeat)."""
    pairs = list(zip(new, old, strict=True))
    times = [n["seconds"] / o["seconds"] for n, o in pairs]
    peaks = [n["peak_mib"] / max(o["peak_mib"], 1.0) for n, o in pairs]
    return {"time": round(statistics.median(times), 3), "peak": round(statistics.median(peaks), 3)}


# ---- the child process ---------------------------------------------------------------------


def child(loader: str, path_text: str, dtype_name: str, device_name: str) -> None:
    """Load once and print ``{"seconds", "peak_mib"}`` as one JSON line."""
    from transformers import AutoConfig

    path, dtype, device = Path(path_text), getattr(torch, dtype_name), torch.device(device_name)
    config = AutoConfig.from_pretrained(path)
    load = _loader(loader)
    before = _resident_mib()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    started = time.perf_counter()
    model = load(path, config, dtype, device)
    seconds = time.perf_counter() - started
    peak = _status_mib("VmHWM") - before
    assert not any(p.is_meta for p in model.parameters())
    print(json.dumps({"seconds": seconds, "peak_mib": peak}))


def _loader(name: str) -> Callable[[Path, Any, torch.dtype, torch.device], torch.nn.Module]:
    from quire_engine.model import weights

    def transformers(path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return torch.nn.Module.to(model, device)

    def direct(path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> Any:
        model = weights.load_whole(path, config, dtype, device)
        assert model is not None, "not a plain safetensors checkpoint"
        return model

    def from_tensors(tensors: dict[str, torch.Tensor], config: Any, dtype: torch.dtype) -> Any:
        model = weights.skeleton(config, dtype)
        weights.fill(model, _Loaded(tensors))
        return model

    def fastsafetensors(path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> Any:
        from fastsafetensors import fastsafe_open

        files = [str(f) for f in sorted(path.glob("*.safetensors"))]
        with fastsafe_open(files, device=str(device), nogds=True) as opened:
            tensors = {k: opened.get_tensor(k).to(device, dtype) for k in opened.keys()}  # noqa: SIM118
        return from_tensors(tensors, config, dtype)

    def runai(path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> Any:
        from runai_model_streamer import SafetensorsStreamer

        files = [str(f) for f in sorted(path.glob("*.safetensors"))]
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files, device=str(device))
            tensors = {k: t.to(device, dtype) for k, t in streamer.get_tensors()}
        return from_tensors(tensors, config, dtype)

    return {
        "transformers": transformers,
        "direct": direct,
        "fastsafetensors": fastsafetensors,
        "runai": runai,
    }[name]


class _Loaded:
    """Tensors another library has already read, as a ``WeightSource`` of whole ones (no copy:
    the loader's own memory is what is measured)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def has(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str, dim: int = 0, parts: tuple[Any, ...] = ()) -> torch.Tensor:
        return self.tensors[name]


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"/proc/self/status has no {field}")


def _resident_mib() -> float:
    return _status_mib("VmRSS")
