"""Every failure leaves the server in OpenAI's error envelope: {"error": {message, type, param, code}}.

Clients (the official SDK among them) read `error.message` and pick an exception class from the
status, so the status is what must be right; `type`/`code` follow OpenAI's own values.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request that cannot be served, with the HTTP status and envelope fields to answer it with."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=_TYPES.get(self.status, "server_error"), param=self.param,
                         code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info()).model_dump(), status_code=self.status,
                            headers=self.headers)

    def sse_event(self) -> bytes:
        """The error as one SSE event, for failures after a stream's 200 header went out."""
        return f"data: {json.dumps(ErrorResponse(error=self.info()).model_dump())}\n\n".encode()


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    """The envelope as bytes, for the ASGI middlewares that answer before FastAPI runs."""
    return APIError(status, message, code=code).response().body


_FIELD = re.compile(r"^(prompt|[a-z_]+ must)\b")


def bad_value(e: ValueError, param: str | None = None) -> APIError:
    """400 for a value the engine refused: the field it names (its `param`, or the start of its message)
    and its `code`, where it has them."""
    message = str(e)
    match = _FIELD.match(message)
    param = param or getattr(e, "param", None) or (match.group(1).removesuffix(" must") if match else None)
    return APIError(400, message, param=param, code=getattr(e, "code", None))


def install_handlers(app: FastAPI) -> None:
    """Envelope for our errors, FastAPI's validation errors (422 → 400), routing errors and crashes."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        # One request's bug fails that request only; the traceback goes to the log, not the client.
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__})").response()


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":  # loc: ("body", character position)
        loc = first.get("loc", ())
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        reason = first.get("ctx", {}).get("error", "")
        return APIError(400, f"request body is not valid JSON{where}" + (f": {reason}" if reason else ""))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    if len(loc) > 1 and _is_union_tag(loc[1]):
        # a union (e.g. prompt: str | list[str] | list[int] | ...): pydantic reports each form it tried
        return APIError(400, f"{param}: the value matches none of the accepted forms", param=param)
    where = ".".join(loc) or "body"
    message = _MESSAGES.get(first.get("type"), first.get("msg", "invalid value"))
    return APIError(400, f"{where}: {message}", param=param)


# pydantic's words where they mislead: orjson reads an integer past 64 bits as a float, and pydantic
# then speaks of parsing a string
_MESSAGES = {"int_parsing_size": "must be an integer that fits in 64 bits"}


def _is_union_tag(part: str) -> bool:
    """True for the names pydantic gives the members of a union in an error's location."""
    return part in ("str", "int", "float", "bool") or "[" in part
