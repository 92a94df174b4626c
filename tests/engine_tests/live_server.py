"""A real uvicorn server on a free loopback port, run in a thread of the test process.

In-process on purpose: the autouse pool check of ``conftest`` then sees the server's KV pool, so a
request that a test leaves holding blocks fails that test. The socket is bound here (port 0) and
handed to uvicorn, so there is no race for a free port.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from quire_engine.core.config import EngineConfig
from quire_engine.engine.async_engine import AsyncEngine
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.server.app import ServerSettings, create_app
from quire_engine.server.drain import Drain
from tests.ports import free_port
from tests.waiting import wait_until

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    drain_: Drain

    def drain(self, timeout: float = 120.0) -> int:
        """Run the SIGTERM drain on the server's event loop; how many requests it ended."""
        loop = self.engine.loop
        assert loop is not None
        return asyncio.run_coroutine_threadsafe(self.drain_.run(), loop).result(timeout)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.base_url, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.base_url, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> Samples:
        """Every sample of /metrics: (name, sorted labels without model_name) -> value."""
        text = httpx2.get(f"{self.url}/metrics").text
        out: Samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(
                    sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
                )
                out[(sample.name, labels)] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics()[(name, tuple(sorted(labels.items())))]

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        wait_until(predicate, timeout=timeout, interval=0.02, message=what)

    def wait_until_ready(self) -> None:
        self.wait_until(lambda: httpx2.get(f"{self.url}/ready").status_code == 200, "ready")

    def wait_until_idle(self) -> Samples:
        """Poll /metrics until no request runs or waits and every block is free."""

        def idle() -> bool:
            m = self.metrics()
            return (
                m[("quire_num_requests_running", ())] == 0
                and m[("quire_num_requests_waiting", ())] == 0
                and m[("quire_kv_blocks_free", ())] == m[("quire_kv_blocks_capacity", ())]
            )

        self.wait_until(idle, "idle")
        return self.metrics()


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The JSON payloads of an SSE stream, in order, with the final ``[DONE]`` as the string."""
    payloads: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


class EngineHolder:
    """An ``engine_factory`` that keeps the engine it built, so a test can reach its runner."""

    def __init__(self) -> None:
        self.engines: list[LLMEngine] = []

    def __call__(self, config: EngineConfig) -> LLMEngine:
        engine = LLMEngine(config)
        self.engines.append(engine)
        return engine

    @property
    def engine(self) -> LLMEngine:
        return self.engines[-1]


def tiny_settings(engine: dict[str, Any] | None = None, **server: Any) -> ServerSettings:
    """The embedded model on CPU with a small pool; ``engine`` overrides ``EngineConfig`` knobs
    by their flat names, the keywords ``ServerSettings`` fields."""
    config = {"device": "cpu", "num_blocks": 256, "max_model_len": 256, "max_num_seqs": 64}
    return ServerSettings(engine=EngineConfig.from_flat(config | (engine or {})), **server)


@contextmanager
def serve(settings: ServerSettings, *, wait_ready: bool = True) -> Iterator[RunningServer]:
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", app.state.engine, app.state.drain)
    try:
        running.wait_until(lambda: server.started or not thread.is_alive(), "uvicorn started")
        if not server.started:
            raise RuntimeError("uvicorn did not start")
        if wait_ready:
            running.wait_until_ready()
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"


@dataclass
class EngineProcess:
    """``quire-engine serve`` in a child process (real signals, real exit codes)."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 120.0) -> None:

        def ready() -> bool:
            assert self.process.poll() is None, self.log()
            return httpx2.get(f"{self.url}/ready").status_code == 200

        wait_until(
            ready,
            timeout=timeout,
            interval=0.1,
            message=lambda: f"{self.url}/ready\n{self.log()}",
            ignore=(httpx2.TransportError,),
        )

    def wait_exit(self, timeout: float = 60.0) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.log()}") from None


@contextmanager
def engine_process(
    log_dir: Path, *flags: str, prelude: str = "", env: dict[str, str] | None = None
) -> Iterator[EngineProcess]:
    """Serve the tiny model on CPU in a child process; ``prelude`` is Python run before the CLI
    (to inject a fault into the real process). The child is killed if the test left it running."""
    port = free_port()
    code = f"{prelude}\nimport sys\nfrom quire_engine.cli import main\nsys.exit(main(sys.argv[1:]))"
    argv = [sys.executable, "-c", code, "serve", "--port", str(port), "--device", "cpu", *flags]
    variables = {k: v for k, v in os.environ.items() if not k.startswith("QUIRE_")}
    variables["PYTHONPATH"] = os.pathsep.join([str(ENGINE_DIR), variables.get("PYTHONPATH", "")])
    log_path = log_dir / f"serve-{port}.log"
    with log_path.open("w") as log:
        child = subprocess.Popen(argv, env={**variables, **(env or {})}, stdout=log, stderr=log)
    try:
        yield EngineProcess(f"http://127.0.0.1:{port}", child, log_path)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
