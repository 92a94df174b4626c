"""The OpenAI-compatible HTTP server: ``create_app(settings)`` builds a FastAPI app around one
``AsyncEngine``; ``ServerSettings`` is what the app is built from.

Ownership: the app's lifespan starts the engine thread (which loads the model) and stops it, which
aborts whatever is still running. Each HTTP request owns the ``RequestHandle`` it submitted and
aborts it in a ``finally`` block, and a watcher task aborts it as soon as the client disconnects
(streaming or not, queued or running), so a gone client frees its blocks within one engine step
(:mod:`.job`).

The app's parts: :mod:`.endpoints` (the /v1 and token endpoints: admission, tokenization,
structured outputs, submission), :mod:`.job` (a submitted request's JSON response or event
stream), :mod:`.errors` (OpenAI-shaped errors and the handlers that answer them),
:mod:`.openapi` (the published schema), :mod:`.middleware` (API key, body limit), :mod:`.drain`
(graceful shutdown). This module wires them and serves ``/health``, ``/ready`` and ``/metrics``.

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: validation
400 (FastAPI's 422 is overridden), bad or missing API key 401 (checked before the body is read;
``/health``, ``/ready`` and ``/metrics`` stay open, ``/docs`` and ``/openapi.json`` do not), unknown
model 404, prompt longer than the context 400 ``context_length_exceeded``, over ``max_waiting``,
not ready, shutting down or engine dead 503 with ``Retry-After``, request bodies over
``max_body_bytes`` 413, a request that failed inside the engine 500 (a stream gets an error event
instead, after the failed choice's final chunk with ``finish_reason`` "abort"), and any other
unhandled exception 500 ``internal_error``.

``/health`` is 503 once the engine loop died or has made no progress for ``step_timeout``
seconds with work pending (the liveness probe then restarts the pod). The published OpenAPI
schema documents these error bodies (400, not FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quire_engine.core import knobs
from quire_engine.core.config import EngineConfig
from quire_engine.core.knobs import knob, section
from quire_engine.engine.async_engine import AsyncEngine
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.metrics import ServerMetrics
from quire_engine.engine.request_handle import EngineUnavailable
from quire_engine.server import tokens_api
from quire_engine.server.adapters import AdapterRegistry, LoRAModule
from quire_engine.server.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain
from quire_engine.server.endpoints import Endpoints
from quire_engine.server.errors import install_error_handlers, unavailable
from quire_engine.server.middleware import ApiKeyGuard, BodyLimit
from quire_engine.server.openapi import openapi_schema
from quire_engine.server.protocol import OpenAIError
from quire_engine.server.reasoning import ReasoningParserName
from quire_engine.server.tool_choice import ToolSettings

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
DEFAULT_MAX_WAITING = 512
DEFAULT_STEP_TIMEOUT_S = 60.0
# vLLM's switch for its runtime adapter endpoints, honoured as well as our flag.
VLLM_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The app's settings, declared as knobs (``core.knobs``; ``serve``'s flags are generated
    from them): ``engine`` is the engine's config tree, ``tools`` the tool-call settings.
    ``max_waiting``: 503 beyond this many queued requests (None: unbounded).
    ``step_timeout``: seconds without engine progress, while work is pending, after which the
    engine counts as hung (None: never). ``shutdown_timeout``: seconds a drain waits for
    requests in flight (see ``drain``). ``vllm_metrics``: /metrics also exports vLLM's names
    for the same data (``engine.vllm_metrics``). ``reasoning_parser``: how chat outputs'
    thinking is split off."""

    engine: EngineConfig = section(EngineConfig)
    served_model_names: tuple[str, ...] = knob(
        ("tiny",),  # the first one names responses and metrics
        "name(s) clients use in 'model'; the first one names responses and metrics "
        "(default: --model)",
        name="served_model_name",
        flag_default=None,
        metavar="NAME",
    )
    api_key: str | None = knob(None, "require 'Authorization: Bearer <key>' on /v1")
    max_waiting: int | None = knob(
        DEFAULT_MAX_WAITING, "answer 503 when this many requests already wait", min=1
    )
    max_body_bytes: int = knob(
        DEFAULT_MAX_BODY_BYTES,
        "answer 413 to larger request bodies",
        name="max_request_bytes",
        min=1,
    )
    step_timeout: float | None = knob(
        DEFAULT_STEP_TIMEOUT_S,
        "seconds without engine progress, while work is pending, after which /health turns 503 "
        "and the server exits 1 (0: never)",
        above=0,
        unit="seconds",
    )
    shutdown_timeout: float = knob(
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "on SIGTERM, seconds requests in flight get to finish before they are ended",
        min=0,
        unit="seconds",
    )
    vllm_metrics: bool = knob(
        True,
        "also export vLLM's metric names (vllm:*) on /metrics, for routers, dashboards and "
        "benchmarks written for vLLM; --no-vllm-metrics exports the quire_* series only",
    )
    lora_modules: tuple[str, ...] | None = knob(
        None,
        "LoRA adapters to serve (with --enable-lora): name=path, or vLLM's JSON "
        '{"name": ..., "path": ...}; clients select one by its name in "model"',
        metavar="NAME=PATH",
    )
    lora_dir: str | None = knob(
        None,
        "directory that relative adapter paths (--lora-modules, /v1/load_lora_adapter) are "
        "resolved under",
        metavar="DIR",
    )
    allow_runtime_lora_updating: bool = knob(
        False,
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true turns it on too)",
    )
    tools: ToolSettings = section(ToolSettings)
    reasoning_parser: ReasoningParserName | None = knob(
        None, "split the model's thinking (<think>...</think>) into reasoning_content"
    )
    engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
    on_engine_death: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        knobs.check(self)
        for text in self.lora_modules or ():
            LoRAModule.parse(text)  # a ValueError now, not at the first request
        if (self.lora_modules or self.allow_runtime_lora_updating or self.lora_dir) and not (
            self.engine.lora.enable_lora
        ):
            raise ValueError(
                "--lora-modules, --lora-dir and --allow-runtime-lora-updating need --enable-lora"
            )


def _runtime_lora_updating(settings: ServerSettings) -> bool:
    allowed = os.environ.get(VLLM_RUNTIME_LORA, "").strip().lower() in ("1", "true")
    return settings.allow_runtime_lora_updating or (allowed and settings.engine.lora.enable_lora)


def create_app(settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(settings.served_model_names[0], vllm=settings.vllm_metrics)
    engine = AsyncEngine(
        settings.engine,
        metrics,
        max_waiting=settings.max_waiting,
        step_timeout=settings.step_timeout,
        engine_factory=settings.engine_factory,
        on_death=settings.on_engine_death,
    )
    adapters = AdapterRegistry(
        engine,
        settings.served_model_names,
        tuple(LoRAModule.parse(text) for text in settings.lora_modules or ()),
        runtime_updates=_runtime_lora_updating(settings),
        lora_dir=settings.lora_dir,
    )
    api = Endpoints(
        engine, settings.served_model_names, settings.tools, settings.reasoning_parser, adapters
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        static = asyncio.create_task(adapters.load_static())
        yield
        static.cancel()
        await engine.stop()
        api.close()

    app = FastAPI(title="Quire", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = Drain(engine, settings.shutdown_timeout)
    # Added last = outermost: the key is checked before the body limit, before anything is read.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyGuard, api_key=settings.api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        engine.check_progress()
        if not engine.alive:
            raise OpenAIError(503, "the engine loop is not running", type="server_error")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        error = engine.not_ready()
        if error is None and not adapters.static_done:
            error = EngineUnavailable(
                "the LoRA adapters are loading", code="not_ready", retry_after=5
            )
        if error is not None:
            raise unavailable(error)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]

    v1 = APIRouter(prefix="/v1")
    v1.add_api_route("/models", api.models, methods=["GET"])
    v1.add_api_route("/completions", api.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", api.chat_completions, methods=["POST"])
    v1.add_api_route("/load_lora_adapter", api.load_lora_adapter, methods=["POST"])
    v1.add_api_route("/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"])
    app.include_router(v1)
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/version", tokens_api.version, methods=["GET"])
    return app
