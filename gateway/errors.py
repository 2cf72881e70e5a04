"""OpenAI-style errors: the `APIError` exception, its JSON shape and the mappings from
gRPC failures and FastAPI validation errors.

Every error the gateway answers has the body
`{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}`,
except on the Anthropic Messages routes (`/v1/messages...`), which answer Anthropic's
`{"type": "error", "error": {"type": str, "message": str}}` (the field named in the message).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from services.errors import HTTP_STATUS, Code, MeshError
from services.rpc import error_from_rpc

log = logging.getLogger(__name__)

# OpenAI `error.type` for each HTTP status the gateway answers.
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


# Anthropic `error.type` for each HTTP status (others: invalid_request_error / api_error).
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_style(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape (the Messages API routes)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_type(status: int) -> str:
    """The OpenAI error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The `{"error": {...}}` body."""
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's `{"type": "error", "error": {...}}` body; the field, when known,
        leads the message as Anthropic writes it (`max_tokens: Field required`)."""
        kind = _ANTHROPIC_TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "api_error"
        )
        message = self.message
        if self.param and not message.startswith(self.param + ":"):
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The error body in the shape of the API that `path` belongs to."""
        return self.anthropic_body() if anthropic_style(path) else self.body()

    def response(self, path: str = "") -> JSONResponse:
        """This error as a JSON response, shaped for the API of `path`."""
        return JSONResponse(self.body_for(path), status_code=self.status, headers=self.headers)


def from_mesh_error(error: MeshError, component: str) -> APIError:
    """Maps a MeshError (usually from `error_from_rpc`) to its HTTP status."""
    status = HTTP_STATUS.get(error.code, 500)
    message = error.message
    if error.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.INTERNAL):
        message = f"{component}: {message}"
    # Clients (the openai SDK included) retry 429/503; tell them when.
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return APIError(status, message, param=error.param, code=error.code.value.lower(), headers=headers)


def from_rpc_error(exc: grpc.aio.AioRpcError, component: str) -> APIError:
    """Maps a failed gRPC call to an APIError; the peer's message is passed through.

    `component` ("tokenizer" / "scheduler") prefixes messages of infrastructure
    failures (unavailable, deadline, internal) so clients can tell which hop failed.
    """
    return from_mesh_error(error_from_rpc(exc), component)


def param_from_loc(loc: Sequence[Any]) -> str | None:
    """`("body", "messages", 0, "role")` → `"messages[0].role"`."""
    parts = [p for p in loc if p != "body"]
    if not parts or isinstance(parts[0], int):
        return None
    text = str(parts[0])
    for part in parts[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def from_validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error as a 400 naming the offending field (`param`)."""
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(
            400, f"We could not parse the JSON body of your request: {detail}", code="invalid_json"
        )
    param = param_from_loc(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind in ("model_attributes_type", "dict_type", "missing"):
            message = "The request body must be a JSON object (Content-Type: application/json)."
        return APIError(400, message, code="invalid_value")
    code = "missing_required_parameter" if kind == "missing" else "invalid_value"
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        message = f"Invalid value for '{param}': {message}"
    return APIError(400, message, param=param, code=code)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI exception handler for APIError."""
    if not isinstance(exc, APIError):  # pragma: no cover - registered for APIError only
        raise exc
    return exc.response(request.url.path)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Turns FastAPI's 422 into an OpenAI-style 400."""
    if not isinstance(exc, RequestValidationError):  # pragma: no cover
        raise exc
    return from_validation_error(exc).response(request.url.path)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette HTTP errors (404 unknown route, 405 ...) in the OpenAI shape."""
    if not isinstance(exc, StarletteHTTPException):  # pragma: no cover
        raise exc
    headers = dict(exc.headers or {})
    return APIError(exc.status_code, str(exc.detail), headers=headers).response(request.url.path)


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Last resort: log and answer 500 without leaking internals."""
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal").response(request.url.path)
