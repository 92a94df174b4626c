"""Servers that ``bench serve --launch`` starts itself, on one model directory, one at a time.

* ``quire``: ``quire-engine serve`` with a paged pool of ``--kv-budget`` tokens.
* ``transformers``: ``transformers serve --continuous-batching`` with its paged cache held to
  the same number of tokens (``--cb-num-blocks``), the model pinned (``FORCE_MODEL``).

Both run on loopback in a child process with one torch thread (``OMP_NUM_THREADS=1``, as the
offline benchmarks), on a free port, and are stopped (SIGINT, then SIGKILL after a grace period)
when the measurement ends. ``build_model_dir`` writes the benchmark Llama (random weights, the
embedded byte tokenizer, no EOS so every request generates exactly ``max_tokens``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2

SYSTEMS = ("quire", "transformers")
START_TIMEOUT_S = 600.0
STOP_GRACE_S = 20.0


@dataclass(frozen=True, slots=True)
class ServerSpec:
    model_dir: Path
    kv_budget: int  # tokens
    block_size: int
    max_model_len: int
    max_batch_tokens: int
    dtype: str
    profile: bool = False  # quire only: serve --profile (the step split on /metrics)


def build_model_dir(
    path: Path, *, hidden: int, layers: int, vocab: int, max_model_len: int, seed: int
) -> Path:
    """The throughput benchmark's Llama, saved with the embedded byte tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    from quire_engine.bench.throughput import llama_config
    from quire_engine.model.tiny_model import build_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(hidden, layers, vocab, max_model_len)).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(system: str, spec: ServerSpec, port: int) -> list[str]:
    if system == "quire":
        return [
            sys.executable, "-m", "quire_engine.cli", "serve",
            "--model", str(spec.model_dir),
            "--served-model-name", str(spec.model_dir),
            "--port", str(port),
            "--device", "cpu",
            "--dtype", spec.dtype,
            "--block-size", str(spec.block_size),
            "--num-blocks", str(spec.kv_budget // spec.block_size),
            "--max-model-len", str(spec.max_model_len),
            "--max-num-batched-tokens", str(spec.max_batch_tokens),
            "--log-level", "warning",
            *(["--profile"] if spec.profile else []),
        ]  # fmt: skip
    if system == "transformers":
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
        if exe is None:
            raise ValueError("the `transformers` CLI is not installed next to this Python")
        return [
            exe, "serve", str(spec.model_dir),
            "--continuous-batching",
            "--cb-block-size", str(spec.block_size),
            "--cb-num-blocks", str(spec.kv_budget // spec.block_size),
            "--cb-max-batch-tokens", str(spec.max_batch_tokens),
            "--device", "cpu",
            "--dtype", spec.dtype,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--log-level", "warning",
        ]  # fmt: skip
    raise ValueError(f"unknown server {system!r}; choose from {', '.join(SYSTEMS)}")


@dataclass(frozen=True, slots=True)
class Launched:
    url: str
    pid: int

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (all its threads)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def launched(system: str, spec: ServerSpec, log_path: Path) -> Iterator[Launched]:
    """Start the server, wait until it answers, yield it, stop it."""
    port = free_port()
    # Quire answers /ready once warmed up; transformers serve loads its pinned model at start
    # and answers /health when its continuous-batching worker lives.
    ready_path = "/ready" if system == "quire" else "/health"
    with started(command(system, spec, port), port, ready_path, log_path, name=system) as server:
        yield server


@contextlib.contextmanager
def started(
    argv: list[str],
    port: int,
    ready_path: str,
    log_path: Path,
    *,
    name: str = "server",
    poll_s: float = 0.5,
) -> Iterator[Launched]:
    """Run ``argv`` (a server listening on ``port`` of loopback, output to ``log_path``) with
    one torch thread and this ``quire_engine`` first on its path, wait until ``ready_path``
    answers 200 (polled every ``poll_s``), yield it, stop it. ``ValueError`` with the log's
    tail when it exits first."""
    # The child imports the quire_engine this process runs (a checkout, not another install).
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url + ready_path, name, log_path, poll_s)
            yield Launched(url, proc.pid)
        finally:
            _stop(proc)


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, name: str, log_path: Path, poll_s: float
) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise ValueError(f"{name} server exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx2.HTTPError):
            if httpx2.get(url, timeout=5.0).status_code == 200:
                return
        time.sleep(poll_s)
    raise ValueError(f"{name} server did not become ready within {START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
