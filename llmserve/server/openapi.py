"""The server's OpenAPI schema, complete and true: what each route answers (a JSON body or an SSE stream), every
error status it can give in OpenAI's envelope, and no 422 (validation errors are answered 400, as OpenAI does).

A client generator, a gateway, or the property-based fuzzer in tests/server/test_fuzz.py read it; the fuzzer
checks the server against it, so a status or a field that is not documented here fails the tests.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from llmserve.server.protocol import ErrorResponse


def _errors(statuses: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": why} for status, why in statuses.items()}


# what every route behind the gate can answer: the key, draining, and a crash kept to its request
OPEN_ERRORS = _errors({401: "missing or wrong API key", 500: "a bug, confined to this request",
                       503: "the model is loading, failed to load, or the server is shutting down"})
MODEL_ERRORS = _errors({401: "missing or wrong API key", 404: "unknown model", 500: "a bug, confined to this request",
                        503: "the model is loading, failed to load, or the server is shutting down"})
STORED_ERRORS = _errors({401: "missing or wrong API key", 404: "no stored response has this id",
                         500: "a bug, confined to this request",
                         503: "the model is loading, failed to load, or the server is shutting down"})
API_ERRORS = _errors({
    400: "invalid request: a bad value, a prompt too long, an invalid JSON schema, ... (`error.param` names it)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body over the limit",
    415: "a body that is not JSON",
    408: "the request's body did not arrive within the request timeout",
    429: "the queue is full (see Retry-After)",
    500: "a bug, confined to this request",
    503: "the model is loading, failed to load, the server is shutting down, or it is at its connection limit "
         "(see Retry-After)",
})


def json_or_sse(model: type[BaseModel]) -> dict[str, Any]:
    """A 200 that is the whole answer as JSON, or (`stream: true`) server-sent events of its chunks."""
    return {"model": model, "description": "the answer; with `stream: true`, server-sent events of its chunks, "
            "ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": SSE_EVENT}}}


# One server-sent event as OpenAPI 3.2 (and schemathesis) describe a `text/event-stream` item: its fields,
# `data` holding a chunk's JSON (or `[DONE]`)
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def complete_openapi(app: FastAPI) -> None:
    """Serve the schema without FastAPI's 422 responses (never sent: validation errors are 400 here)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
