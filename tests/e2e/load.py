"""Closed-loop load over the ready engines, round-robin as a Service would spread it.

``concurrency`` worker threads each send one completion at a time with the official ``openai``
client (greedy, ``ignore_eos`` so every request generates exactly ``max_tokens``), picking the next
ready engine for every request. The load is bounded: it stops after ``max_requests`` requests or
when ``stop()`` is called, whichever comes first.

Ownership: the workers and their clients belong to the ``Load``; ``stop()`` joins them. A request
cut off by its engine stopping (scale-in) counts as an error, not a failure of the test.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import openai

from tests.e2e.pod_runner import Engine


class Target(NamedTuple):
    """Where requests go when that is not an engine (a gateway): its URL and a name for errors."""

    url: str
    pod: str


@dataclass
class Load:
    engines: Callable[[], Sequence[Engine | Target]]
    model: str
    concurrency: int
    prompt: list[int] | str
    max_tokens: int
    max_requests: int
    sent: int = 0
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    _threads: list[threading.Thread] = field(default_factory=list)
    _clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def start(self) -> None:
        self.grow(self.concurrency)

    def grow(self, clients: int) -> None:
        """Add ``clients`` more workers (a ramp); ``concurrency`` counts them all."""
        for _ in range(clients):
            thread = threading.Thread(
                target=self._work, name=f"load-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        self.concurrency = len(self._threads)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        for api in self._clients.values():
            api.close()

    def _next(self) -> tuple[openai.OpenAI, str] | None:
        engines = self.engines()
        with self._lock:
            if not engines or self.sent >= self.max_requests:
                return None
            engine = engines[next(self._turn) % len(engines)]
            self.sent += 1
            if engine.url not in self._clients:
                self._clients[engine.url] = openai.OpenAI(
                    base_url=f"{engine.url}/v1", api_key="unused", max_retries=0, timeout=120
                )
            return self._clients[engine.url], engine.pod

    def _work(self) -> None:
        while not self._stop.is_set():
            picked = self._next()
            if picked is None:
                with self._lock:
                    exhausted = self.sent >= self.max_requests
                if exhausted:
                    return
                self._stop.wait(0.2)
                continue
            api, pod = picked
            try:
                api.completions.create(
                    model=self.model,
                    prompt=self.prompt,
                    max_tokens=self.max_tokens,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                with self._lock:
                    self.completed += 1
            except openai.OpenAIError as err:
                with self._lock:
                    self.errors.append(f"{pod}: {type(err).__name__}: {err}")
                self._stop.wait(0.2)
