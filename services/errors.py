"""Error taxonomy shared by every service.

Domain code raises these (or plain `ValueError` for bad input) without importing grpc;
`services.rpc` maps them to gRPC status codes and the gateway maps those to HTTP.
"""

from __future__ import annotations

from enum import StrEnum

from google.rpc import code_pb2


class Code(StrEnum):
    """Transport-neutral status codes; values equal gRPC `StatusCode` names."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"
    ABORTED = "ABORTED"
    INTERNAL = "INTERNAL"


# HTTP status the gateway answers for each code (OpenAI-style clients retry 429/503).
HTTP_STATUS: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 400,
    Code.FAILED_PRECONDITION: 400,
    Code.NOT_FOUND: 404,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.CANCELLED: 499,
    Code.ABORTED: 409,
    Code.INTERNAL: 500,
}


def status_number(code: Code) -> int:
    """The numeric status code (google.rpc.Code, the numbers gRPC uses), for messages that
    carry a status inside a stream (worker RequestError, RouteError) where no call status
    exists."""
    return int(code_pb2.Code.Value(code.value))


class MeshError(Exception):
    """Base class: an error with a status code and a client-safe message."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The request field at fault, if any (OpenAI error `param`).
        self.param = param


class InvalidArgument(MeshError):
    code = Code.INVALID_ARGUMENT


class NotFound(MeshError):
    code = Code.NOT_FOUND


class Overloaded(MeshError):
    code = Code.RESOURCE_EXHAUSTED


class Unavailable(MeshError):
    code = Code.UNAVAILABLE


class PermissionDenied(MeshError):
    code = Code.PERMISSION_DENIED


class Aborted(MeshError):
    code = Code.ABORTED


def classify(exc: BaseException) -> tuple[Code, str]:
    """The status code and message to report for an exception raised by a handler."""
    if isinstance(exc, MeshError):
        return exc.code, exc.message
    if isinstance(exc, ValueError):
        return Code.INVALID_ARGUMENT, str(exc) or "invalid argument"
    if isinstance(exc, TimeoutError):
        return Code.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, MemoryError):
        return Code.RESOURCE_EXHAUSTED, "out of memory"
    return Code.INTERNAL, f"internal error: {type(exc).__name__}"


def error_from_status(number: int, message: str, param: str | None = None) -> MeshError:
    """The MeshError of a numeric status code (INTERNAL for numbers we do not know)."""
    name = code_pb2.Code.Name(number) if number in code_pb2.Code.values() else ""
    code = Code(name) if name in Code.__members__ else Code.INTERNAL
    error = MeshError(message, param=param or None)
    error.code = code
    return error
