"""The server's errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
the ``OpenAIError`` values for the engine's failures, and the exception handlers that answer
every error (FastAPI's validation 422 as a 400, Starlette's HTTP errors, anything unhandled as
a 500 ``internal_error``) in that shape.

Stateless: :func:`install_error_handlers` registers the handlers on an app once, at build time.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quire_engine.engine.request_handle import EngineUnavailable
from quire_engine.server.protocol import OpenAIError


def request_failed(message: str) -> OpenAIError:
    """A request that failed inside the engine (the engine itself went on)."""
    return OpenAIError(500, message, type="server_error", code="request_failed")


def internal_error(exc: Exception) -> OpenAIError:
    """Any exception nothing else handled, named by its type only."""
    return OpenAIError(
        500,
        f"internal server error: {type(exc).__name__}",
        type="server_error",
        code="internal_error",
    )


def unavailable(exc: EngineUnavailable) -> OpenAIError:
    """A 503 with ``Retry-After``: not ready, over ``max_waiting``, shutting down, engine dead."""
    return OpenAIError(
        503,
        str(exc),
        type="server_error",
        code=exc.code,
        headers={"Retry-After": str(exc.retry_after)},
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)


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
    return await _openai_error(request, internal_error(exc))
