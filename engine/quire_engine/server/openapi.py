"""The published OpenAPI schema: FastAPI's, corrected to the errors this server really answers
(OpenAI-shaped 400s where FastAPI documents its 422, the other error statuses as a default
response; see :mod:`.errors`).

Ownership: the schema is built on first request and cached on the app (``app.openapi_schema``).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from quire_engine.server.protocol import Json

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


def openapi_schema(app: FastAPI) -> Json:
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
