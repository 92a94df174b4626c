"""ASGI middleware in front of the app: the API key check and the request-body limit.

Both act before FastAPI reads a body: an unauthenticated client cannot make the server read,
parse or validate anything (malformed JSON from it is a 401, not a 400), and an oversized body is
refused from its Content-Length or while it streams in. Only the probes and ``/metrics`` are
open without the key; ``/docs`` and ``/openapi.json`` follow it like ``/v1``.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quire_engine.server.protocol import OpenAIError

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyGuard:
    """401 (``invalid_api_key``) unless ``Authorization: Bearer <key>`` matches, for every path
    but ``OPEN_PATHS``; answered from the headers alone."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest: the time taken must not reveal how much of a guessed key was right.
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.key):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            401,
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await JSONResponse(error.body(), status_code=401, headers=error.headers)(
            scope, receive, send
        )


class BodyLimit:
    """413 for a body over ``max_bytes``: at once from Content-Length, or while a chunked body is
    read (raised as an HTTPException, which FastAPI passes through to the app's handlers)."""

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
