"""The generation endpoints served straight from the gateway middleware, past
FastAPI's router, dependency solving and response wrapping.

Why: those layers are on a streamed request's time to first token, and every chunk of
every stream went through three more `send` wrappers (docs/design-decisions.md,
"Generation endpoints served past FastAPI's router"). Only well-formed requests are
taken here: POST with a JSON content type and a body that parses to an object and
validates against the endpoint's request model, exactly the requests for which FastAPI
would call the endpoint. Anything else (a malformed body, a wrong content type) goes on
to the FastAPI app, whose error answer stays the reference. FastAPI still declares the
routes (OpenAPI schema, 405 for other methods).

The endpoint gets what FastAPI would give it (the validated model, a Request on the
same scope) and its result is answered the same way: a Response as is, a model
serialized as FastAPI does (`by_alias`, every field, JSON bytes from pydantic), an
APIError as its JSON error. Other exceptions propagate to Starlette's
ServerErrorMiddleware, as they do from FastAPI's routes.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.errors import APIError

Endpoint = Callable[[Any, Request], Awaitable[Any]]


@dataclass(frozen=True)
class DirectRoute:
    """One endpoint: `endpoint(body, request)`, its request model and its response model."""

    endpoint: Endpoint
    request_model: type[pydantic.BaseModel]
    response_adapter: pydantic.TypeAdapter[Any]

    @classmethod
    def of(cls, endpoint: Endpoint, response_model: Any) -> DirectRoute:
        """The route of `endpoint`, whose `body` parameter is annotated with its request model."""
        request_model = typing.get_type_hints(endpoint)["body"]
        return cls(endpoint, request_model, pydantic.TypeAdapter(response_model))

    async def serve(self, content_type: str, body: bytes, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answers a well-formed request and returns True; False (nothing sent) when
        FastAPI should answer it (an error)."""
        parsed = self._parse(content_type, body)
        if parsed is None:
            return False
        await self._run(parsed, scope, receive, send)
        return True

    def _parse(self, content_type: str, body: bytes) -> pydantic.BaseModel | None:
        """The validated request, or None when it is not well-formed."""
        if not _is_json(content_type):
            return None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # bad JSON or UTF-8; nesting too deep
            return None
        if not isinstance(data, dict):
            return None
        try:
            return self.request_model.model_validate(data)
        except pydantic.ValidationError:
            return None

    async def _run(self, parsed: pydantic.BaseModel, scope: Scope, receive: Receive, send: Send) -> None:
        """Runs the endpoint and sends its answer."""
        request = Request(scope, receive, send)
        try:
            result = await self.endpoint(parsed, request)
        except APIError as exc:
            result = exc.response()
        if not isinstance(result, Response):
            result = Response(
                self.response_adapter.dump_json(result, by_alias=True), media_type="application/json"
            )
        await result(scope, receive, send)


def _is_json(content_type: str) -> bool:
    """FastAPI's rule: application/json or application/*+json (no content type: not JSON)."""
    media = content_type.split(";", 1)[0].strip().lower()
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))
