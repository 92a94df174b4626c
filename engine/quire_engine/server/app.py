"""The OpenAI-compatible HTTP server: ``create_app(settings)`` builds a FastAPI app around one
``AsyncEngine``.

Ownership: the app's lifespan starts the engine thread (which loads the model) and stops it, which
aborts whatever is still running. Each HTTP request owns the ``RequestHandle`` it submitted and
aborts it in a ``finally`` block, and a watcher task aborts it as soon as the client disconnects
(streaming or not, queued or running), so a gone client frees its blocks within one engine step.

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: validation
400 (FastAPI's 422 is overridden), bad or missing API key 401 (checked before the body is read;
``/health``, ``/ready`` and ``/metrics`` stay open, ``/docs`` and ``/openapi.json`` do not), unknown
model 404, prompt longer than the context 400 ``context_length_exceeded``, over ``max_waiting``,
not ready, shutting down or engine dead 503 with ``Retry-After``, request bodies over
``max_body_bytes`` 413, a request that failed inside the engine 500 (a stream gets an error event
instead, after the failed choice's final chunk with ``finish_reason`` "abort"), and any other
unhandled exception 500 ``internal_error``.

Tokenization and chat templates run on one worker thread (``PromptEncoder``), so a large body
never blocks the event loop. ``/health`` is 503 once the engine loop died or has made no
progress for ``step_timeout`` seconds with work pending (the liveness probe then restarts the
pod). The published OpenAPI schema documents these error bodies (400, not FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from quire_engine.core import knobs
from quire_engine.core.config import EngineConfig
from quire_engine.core.constraint import OutputConstraint
from quire_engine.core.knobs import knob, section
from quire_engine.core.outputs import RequestOutput
from quire_engine.core.sampling_params import SamplingParams
from quire_engine.engine.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    ModelInfo,
    RequestHandle,
)
from quire_engine.engine.llm_engine import LLMEngine
from quire_engine.engine.metrics import ServerMetrics
from quire_engine.server import tokens_api
from quire_engine.server.choice_parser import OutputFormat
from quire_engine.server.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain
from quire_engine.server.middleware import ApiKeyGuard, BodyLimit
from quire_engine.server.prompt_encoder import PromptEncoder
from quire_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Json,
    OpenAIError,
    SamplingRequest,
)
from quire_engine.server.reasoning import ReasoningParserName
from quire_engine.server.rendering import (
    ChatRenderer,
    CompletionRenderer,
    Echo,
    Renderer,
    prompt_logprobs_json,
    stream_choices,
    usage,
)
from quire_engine.server.token_text import TokenText
from quire_engine.server.tool_choice import ToolSettings, plan

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Fields the engine validates against itself (max_num_seqs, the vocabulary).
_ENGINE_CHECKED = frozenset(
    {"n", "stop_token_ids", "allowed_token_ids", "logit_bias", "beam_width"}
)
DEFAULT_MAX_WAITING = 512
DEFAULT_STEP_TIMEOUT_S = 60.0


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
    tools: ToolSettings = section(ToolSettings)
    reasoning_parser: ReasoningParserName | None = knob(
        None, "split the model's thinking (<think>...</think>) into reasoning_content"
    )
    engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
    on_engine_death: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        knobs.check(self)


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
    api = _Api(settings, engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
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
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health() -> Response:
        engine.check_progress()
        if not engine.alive:
            raise OpenAIError(503, "the engine loop is not running", type="server_error")
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        error = engine.not_ready()
        if error is not None:
            raise _unavailable(error)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    v1 = APIRouter(prefix="/v1")
    v1.add_api_route("/models", api.models, methods=["GET"])
    v1.add_api_route("/completions", api.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", api.chat_completions, methods=["POST"])
    app.include_router(v1)
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/version", tokens_api.version, methods=["GET"])
    return app


class _Api:
    """The /v1 endpoints; one instance per app."""

    def __init__(self, settings: ServerSettings, engine: AsyncEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.created = int(time.time())
        self._encoder: PromptEncoder | None = None
        # Grammars compile here, never on the event loop or the engine's step loop.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="quire-grammar")

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
        self._compiler.shutdown(wait=False, cancel_futures=True)

    async def constraint(self, body: SamplingRequest, info: ModelInfo) -> OutputConstraint | None:
        """The request's structured-output constraint, compiled (a cache hit for one seen
        before); a 400 with the compiler's message when it does not compile."""
        asked = body.constraint()
        if asked is None:
            return None
        return await self.compile(*asked, info)

    async def compile(
        self, constraint: OutputConstraint, param: str, info: ModelInfo
    ) -> OutputConstraint:
        if info.grammars is None:
            raise OpenAIError(400, "structured outputs are off on this server", param=param)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._compiler, info.grammars.compile, constraint)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param=param) from exc
        return constraint

    def encoder(self, info: ModelInfo) -> PromptEncoder:
        if self._encoder is None:
            self._encoder = PromptEncoder(info.tokenizer)
        return self._encoder

    async def models(self) -> Json:
        info = self.engine.info
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "quire",
                "root": info.model_name if info else None,
                "max_model_len": info.max_model_len if info else None,
            }
            for name in self.settings.served_model_names
        ]
        return {"object": "list", "data": cards}

    async def tokenize(self, body: tokens_api.TokenizeRequest) -> Json:
        info = self._model(body.model)
        return await tokens_api.tokenize(
            body, self.encoder(info), info.tokenizer, info.max_model_len
        )

    async def detokenize(self, body: tokens_api.DetokenizeRequest) -> Json:
        info = self._model(body.model)
        return await tokens_api.detokenize(body, self.encoder(info), info.vocab_size)

    def _model(self, model: str | None) -> ModelInfo:
        """The model's info for a request naming ``model`` (404 for another name, 503 while
        the engine is not ready)."""
        self._check_model(model)
        error = self.engine.not_ready()
        if error is not None:
            raise _unavailable(error)
        assert self.engine.info is not None
        return self.engine.info

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        texts = body.prompts()
        info = self._admit(body, len(texts))
        encoder = self.encoder(info)
        prompts = [await encoder.prompt(text, body.add_special_tokens) for text in texts]
        # echo with logprobs shows the prompt's logprobs too (vLLM's rule).
        echo_logprobs = body.logprobs if body.echo else None
        requested = 1 if body.echo_only else body.max_tokens
        constraint = await self.constraint(body, info)
        params = [
            body.sampling_params(
                _max_tokens(info, len(p), requested, "prompt"),
                body.logprobs,
                info.sampling_defaults,
                prompt_logprobs=echo_logprobs,
                constraint=constraint,
            )
            for p in prompts
        ]
        echoes: list[Echo | None] = []
        if body.echo:
            for text, ids in zip(texts, prompts, strict=True):
                shown = text if isinstance(text, str) else await encoder.decode(ids, True)
                echoes.append(Echo(shown, ids))
        renderer = CompletionRenderer(
            TokenText(info.tokenizer, body.return_tokens_as_token_ids),
            body.n,
            echoes,
            generated=not body.echo_only,
        )
        return await self._generate(request, body, "cmpl", prompts, params, renderer, arrival)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        conversation = body.conversation()
        template_kwargs = body.template_kwargs()
        num_logprobs = body.num_logprobs
        info = self._admit(body, 1)
        if not info.tokenizer.chat_template and body.chat_template is None:
            # No fallback: another model's template would silently produce the wrong format.
            raise OpenAIError(
                400,
                "the model's tokenizer has no chat template; use /v1/completions, or start the "
                "server with --chat-template",
                param="messages",
            )
        tools = plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.settings.tools)
        if body.tools:
            template = body.chat_template or info.tokenizer.chat_template
            if "tools" not in str(template):
                raise OpenAIError(
                    400,
                    "the chat template does not render tools; start the server with a "
                    "--chat-template that does, or send one in chat_template",
                    param="tools",
                )
        prompt = await self.encoder(info).chat(
            conversation, template_kwargs, body.add_special_tokens
        )
        max_tokens = _max_tokens(info, len(prompt), body.requested_max_tokens, "messages")
        constraint = await self.constraint(body, info)
        if tools.constraint is not None:
            if constraint is not None:
                raise OpenAIError(
                    400,
                    f"tool_choice {tools.mode} does not combine with response_format or "
                    "structured_outputs",
                    param="tool_choice",
                )
            constraint = await self.compile(tools.constraint, "tools", info)
        reasoning = self.settings.reasoning_parser if body.enable_thinking else None
        fmt = OutputFormat(
            reasoning,
            body.include_reasoning,
            tools.parser,
            tools.max_calls,
            forced=tools.constraint is not None,
        )
        params = [
            body.sampling_params(
                max_tokens, num_logprobs, info.sampling_defaults, constraint=constraint
            )
        ]
        renderer = ChatRenderer(
            TokenText(info.tokenizer, body.return_tokens_as_token_ids),
            num_logprobs or 0,
            body.echo_text,
            body.n,
            fmt,
        )
        return await self._generate(request, body, "chatcmpl", [prompt], params, renderer, arrival)

    def _admit(self, body: SamplingRequest, num_prompts: int) -> ModelInfo:
        self._check_model(body.model)
        limit = self.engine.max_waiting
        if limit is not None and num_prompts > limit:
            raise OpenAIError(
                400,
                f"at most {limit} prompts per request (max_waiting); got {num_prompts}",
                param="prompt",
            )
        try:
            return self.engine.check_admission(num_prompts)
        except EngineUnavailable as exc:
            raise _unavailable(exc) from exc

    async def _generate(
        self,
        request: Request,
        body: SamplingRequest,
        prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        renderer: Renderer,
        arrival: float,
    ) -> Response:
        # vLLM's order: the X-Request-Id header (a gateway sets one per request and logs it),
        # then the body's request_id, then a fresh one.
        given = request.headers.get("x-request-id") or body.request_id
        request_id = f"{prefix}-{given or uuid.uuid4().hex}"
        try:
            handle = await self.engine.submit(
                request_id,
                prompts,
                params,
                arrival=arrival,
                beam_width=body.beam_width,
                cache_salt=body.cache_salt,
            )
        except ValueError as exc:  # the engine's checks name the field first
            field = re.match(r"[a-z_]+", str(exc))
            param = field.group() if field and field.group() in _ENGINE_CHECKED else "prompt"
            if "duplicate request id" in str(exc):
                param = "request_id"
            raise OpenAIError(400, str(exc), param=param) from exc
        except EngineUnavailable as exc:
            raise _unavailable(exc) from exc
        head = {"id": request_id, "created": int(time.time())}
        head["model"] = self.settings.served_model_names[0]
        job = _Job(
            handle=handle,
            watcher=asyncio.create_task(_abort_on_disconnect(request, handle)),
            renderer=renderer,
            head=head,
            n=body.n,
            num_prompt_tokens=sum(len(p) for p in prompts),
        )
        if not body.stream:
            return await _respond(job)
        holdback = max((len(stop) for stop in params[0].stop), default=1) - 1
        return StreamingResponse(
            _sse(job, body.include_usage, holdback),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


@dataclass(slots=True)
class _Job:
    """A submitted HTTP request on its way out. ``close()`` must run whatever happens."""

    handle: RequestHandle
    watcher: asyncio.Task[None]  # aborts the handle when the client disconnects
    renderer: Renderer
    head: Json  # id, created, model
    n: int
    num_prompt_tokens: int

    def close(self) -> None:
        self.watcher.cancel()
        self.handle.abort()


async def _respond(job: _Job) -> Response:
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in job.handle.outputs():
            finals[index] = out
            if job.handle.error is not None:
                break  # close() aborts the other prompts
    except EngineUnavailable as exc:
        raise _unavailable(exc) from exc
    finally:
        job.close()
    if job.handle.error is not None:
        raise _failed(job.handle.error)
    if job.handle.aborted:
        return Response(status_code=499)  # the client is gone; nobody reads this
    renderer = job.renderer
    choices = []
    for index, out in sorted(finals.items()):
        renderer.observe(index, out)
        for sample in out.outputs:
            choice = renderer.full_choice(index * job.n + sample.index, sample)
            if isinstance(renderer, CompletionRenderer) and out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(renderer.text, out.prompt_logprobs)
            choices.append(choice)
    completion_tokens = sum(len(s.token_ids) for out in finals.values() for s in out.outputs)
    response = {**job.head, "object": renderer.object, "choices": choices}
    if isinstance(renderer, ChatRenderer) and finals and finals[0].prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(renderer.text, finals[0].prompt_logprobs)
    response["usage"] = usage(job.num_prompt_tokens, completion_tokens, renderer.cached_tokens)
    return JSONResponse(response)


async def _sse(job: _Job, include_usage: bool, holdback: int) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice update, the usage chunk if asked, ``[DONE]``."""
    head = {**job.head, "object": job.renderer.chunk_object}
    extra: Json = {"usage": None} if include_usage else {}
    try:
        completion_tokens = 0
        async for choice, tokens in stream_choices(job.handle, job.renderer, job.n, holdback):
            completion_tokens += tokens
            yield _event({**head, "choices": [choice], **extra})
            if job.handle.error is not None:
                break  # close() aborts the other prompts
        if job.handle.error is not None:
            yield _event(_failed(job.handle.error).body())
        elif job.handle.aborted:
            return
        elif include_usage:
            totals = usage(job.num_prompt_tokens, completion_tokens, job.renderer.cached_tokens)
            yield _event({**head, "choices": [], "usage": totals})
    except EngineUnavailable as exc:
        yield _event(_unavailable(exc).body())
    except Exception as exc:  # the response has started: report in the stream, not as a 500
        logger.exception("streaming %s failed", job.head["id"])
        yield _event(_internal(exc).body())
    finally:
        job.close()
    yield "data: [DONE]\n\n"


async def _abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn sends it when
    # the socket closes, whether or not the response started).
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.abort()


def _event(payload: Json) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _max_tokens(info: ModelInfo, num_prompt: int, requested: int | None, param: str) -> int:
    """``requested`` checked against the context (vLLM's wording); None means "the rest of it"."""
    limit = info.max_model_len
    if num_prompt >= limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input.",
            param=param,
            code="context_length_exceeded",
        )
    if requested is None:
        return limit - num_prompt
    if num_prompt + requested > limit:
        raise OpenAIError(
            400,
            f"'max_tokens' is too large: {requested}. This model's maximum context length is "
            f"{limit} tokens and your request has {num_prompt} input tokens "
            f"({requested} > {limit} - {num_prompt}).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _failed(message: str) -> OpenAIError:
    """A request that failed inside the engine (the engine itself went on)."""
    return OpenAIError(500, message, type="server_error", code="request_failed")


def _internal(exc: Exception) -> OpenAIError:
    return OpenAIError(
        500,
        f"internal server error: {type(exc).__name__}",
        type="server_error",
        code="internal_error",
    )


def _unavailable(exc: EngineUnavailable) -> OpenAIError:
    return OpenAIError(
        503,
        str(exc),
        type="server_error",
        code=exc.code,
        headers={"Retry-After": str(exc.retry_after)},
    )


# ---- errors ---------------------------------------------------------------------------------
_ERROR_SCHEMA: Json = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}


def _openapi(app: FastAPI) -> Json:
    """FastAPI's schema with the errors this server really answers: OpenAI-shaped 400s where
    FastAPI documents its 422, and the other error statuses as a default response."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["OpenAIError"] = _ERROR_SCHEMA
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error = {"$ref": "#/components/schemas/OpenAIError"}
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.setdefault("responses", {})
                if responses.pop("422", None) is not None:
                    content = {"application/json": {"schema": error}}
                    responses["400"] = {"description": "Invalid request", "content": content}
                responses["default"] = {
                    "description": "Error (OpenAI's shape)",
                    "content": {"application/json": {"schema": error}},
                }
        app.openapi_schema = schema
    return app.openapi_schema


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # One problem per top-level field: pydantic reports every member of a union separately
    # ("prompt.str: ...; prompt.list[int]: ..."), which buries the point.
    problems: dict[str, str] = {}
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        problems.setdefault(loc[0] if loc else "body", f"{'.'.join(loc) or 'body'}: {error['msg']}")
    message = "; ".join(problems.values()) or "invalid request"
    param = next((field for field in problems if field != "body"), None)
    return await _openai_error(request, OpenAIError(400, message, param=param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    error = OpenAIError(
        exc.status_code,
        str(exc.detail),
        type="invalid_request_error" if exc.status_code < 500 else "server_error",
        code=codes.get(exc.status_code),
        headers=dict(exc.headers or {}),
    )
    return await _openai_error(request, error)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette's ServerErrorMiddleware calls this for any exception nothing else handled (and
    # re-raises it afterwards, so it is logged with its traceback).
    return await _openai_error(request, _internal(exc))
