"""The OpenAI-compatible HTTP server: ``create_app(settings)`` builds a FastAPI app around one
``AsyncEngine``.

Ownership: the app's lifespan starts the engine thread (which loads the model) and stops it, which
aborts whatever is still running. Each HTTP request owns the ``RequestHandle`` it submitted and
aborts it in a ``finally`` block, and a watcher task aborts it as soon as the client disconnects
(streaming or not, queued or running), so a gone client frees its blocks within one engine step.

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: validation
400 (FastAPI's 422 is overridden), bad or missing API key 401 (``/health``, ``/ready`` and
``/metrics`` stay open), unknown model 404, prompt longer than the context 400
``context_length_exceeded``, over ``max_waiting`` or not ready 503 with ``Retry-After``, request
bodies over ``max_body_bytes`` 413.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quire_engine.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    ModelInfo,
    RequestHandle,
)
from quire_engine.config import EngineConfig
from quire_engine.engine import LLMEngine
from quire_engine.metrics import ServerMetrics
from quire_engine.outputs import RequestOutput
from quire_engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Json,
    OpenAIError,
    SamplingRequest,
)
from quire_engine.rendering import (
    ChatRenderer,
    CompletionRenderer,
    Renderer,
    stream_choices,
    usage,
)
from quire_engine.sampling_params import SamplingParams

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True, slots=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_names: tuple[str, ...] = ("tiny",)  # the first one names responses and metrics
    api_key: str | None = None
    max_waiting: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
    on_engine_death: Callable[[], None] | None = None


def create_app(settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(settings.served_model_names[0])
    engine = AsyncEngine(
        settings.engine,
        metrics,
        max_waiting=settings.max_waiting,
        engine_factory=settings.engine_factory,
        on_death=settings.on_engine_death,
    )
    api = _Api(settings, engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="Quire", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]

    @app.get("/health")
    async def health() -> Response:
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

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api.authorize)])
    v1.add_api_route("/models", api.models, methods=["GET"])
    v1.add_api_route("/completions", api.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", api.chat_completions, methods=["POST"])
    app.include_router(v1)
    return app


class _Api:
    """The /v1 endpoints; one instance per app."""

    def __init__(self, settings: ServerSettings, engine: AsyncEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.created = int(time.time())
        self._api_key = settings.api_key.encode() if settings.api_key else None

    async def authorize(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of a guessed key was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self._api_key):
            raise OpenAIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

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

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        texts = body.prompts()
        info = self._admit(body, len(texts))
        prompts = [_encode(info, text) for text in texts]
        params = [
            body.sampling_params(
                _max_tokens(info, len(p), body.max_tokens, "prompt"),
                body.logprobs,
                info.sampling_defaults,
            )
            for p in prompts
        ]
        renderer = CompletionRenderer(info.tokenizer)
        return await self._generate(request, body, "cmpl", prompts, params, renderer, arrival)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        conversation = body.conversation()
        num_logprobs = body.num_logprobs
        info = self._admit(body, 1)
        tokenizer = info.tokenizer
        if not tokenizer.chat_template:
            # No fallback: another model's template would silently produce the wrong format.
            raise OpenAIError(
                400,
                "the model's tokenizer has no chat template; use /v1/completions, or start the "
                "server with --chat-template",
                param="messages",
            )
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=body.add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises for conversations the template refuses
            raise OpenAIError(
                400, f"cannot apply the chat template: {exc}", param="messages"
            ) from exc
        # The template already placed any special tokens the model expects.
        prompt = list(tokenizer(text, add_special_tokens=False).input_ids)
        max_tokens = _max_tokens(info, len(prompt), body.requested_max_tokens, "messages")
        params = [body.sampling_params(max_tokens, num_logprobs, info.sampling_defaults)]
        renderer = ChatRenderer(info.tokenizer, num_logprobs or 0)
        return await self._generate(request, body, "chatcmpl", [prompt], params, renderer, arrival)

    def _admit(self, body: SamplingRequest, num_prompts: int) -> ModelInfo:
        if body.model is not None and body.model not in self.settings.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{body.model}` does not exist.",
                param="model",
                code="model_not_found",
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
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            handle = await self.engine.submit(request_id, prompts, params, arrival=arrival)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="prompt") from exc
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
    except EngineUnavailable as exc:
        raise _unavailable(exc) from exc
    finally:
        job.close()
    if job.handle.aborted:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = [
        job.renderer.full_choice(index * job.n + sample.index, sample)
        for index, out in sorted(finals.items())
        for sample in out.outputs
    ]
    completion_tokens = sum(len(s.token_ids) for out in finals.values() for s in out.outputs)
    response = {**job.head, "object": job.renderer.object, "choices": choices}
    response["usage"] = usage(job.num_prompt_tokens, completion_tokens)
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
        if job.handle.aborted:
            return
        if include_usage:
            totals = usage(job.num_prompt_tokens, completion_tokens)
            yield _event({**head, "choices": [], "usage": totals})
    except EngineUnavailable as exc:
        yield _event(_unavailable(exc).body())
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


def _encode(info: ModelInfo, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return list(info.tokenizer(prompt).input_ids)
    return prompt  # token ids: the engine checks their range


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


def _unavailable(exc: EngineUnavailable) -> OpenAIError:
    return OpenAIError(
        503,
        str(exc),
        type="server_error",
        code=exc.code,
        headers={"Retry-After": str(exc.retry_after)},
    )


# ---- errors ---------------------------------------------------------------------------------
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


class _BodyLimit:
    """413 for a body over ``max_bytes``: at once from Content-Length, or while a chunked body is
    read (raised as an HTTPException, which FastAPI passes through to the handlers above)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"request body larger than {self.max_bytes} bytes"
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = OpenAIError(413, too_large, code="request_too_large")
            response = JSONResponse(error.body(), status_code=413)
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, limited, send)
