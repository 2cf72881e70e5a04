"""`create_app(config)`: the FastAPI application of the gateway.

Routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models[/{model}],
/tokenize, /detokenize (vLLM shapes), /health, /metrics, and with --enable-lora-updating
/v1/load_lora_adapter, /v1/unload_lora_adapter (gateway.lora_admin). Middleware (drain, auth, rate
limit, body limit, metrics) is in gateway.middleware; every error is an OpenAI error
object (gateway.errors). The gRPC channels are opened in the lifespan (start-up).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import chat, completions, messages_api, responses_api
from gateway.background import BackgroundResponses
from gateway.budgets import tenant_budgets
from gateway.classes import priority_classes
from gateway.config import GatewayConfig
from gateway.direct_routes import DirectRoute
from gateway.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    unhandled_error_handler,
    validation_error_handler,
)
from gateway.lora_admin import load_lora_adapter, unload_lora_adapter
from gateway.middleware import GatewayMiddleware, GatewayState
from gateway.protocol import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.request_specs import new_id
from gateway.response_store import ResponseStore
from gateway.serving import background_context
from gateway.upstream import TOKENIZER, Upstream, adapter_parents
from meshserve.v1 import common_pb2, tokenizer_pb2
from services import tracing
from services.gc_tuning import settle_heap

VERSION = "0.1.0"


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {
        400: "Invalid request (the `param` field names the offending field)",
        401: "Missing or invalid API key",
        403: "Not an admin API key",
        404: "Unknown model",
        413: "Request body too large",
        429: "Rate limited (per API key) or the scheduler is overloaded; see Retry-After",
        500: "Internal error",
        503: "An upstream service is unavailable, or the gateway is draining",
        504: "Upstream deadline exceeded",
    }
    return {s: {"model": ErrorResponse, "description": descriptions[s]} for s in statuses}


_COMMON = (401, 429, 500, 503)
_GENERATION_ERRORS = _errors(400, 404, 413, *_COMMON, 504)
_SSE = {
    "description": "JSON object, or with `stream: true` server-sent events: `data: <chunk JSON>` "
    "events, then `data: [DONE]`. A failure after the stream started is sent as a final "
    '`data: {"error": {...}}` event before `[DONE]`.',
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


def create_app(config: GatewayConfig) -> FastAPI:
    """Builds the gateway app; gRPC channels open when the app starts (lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tracing.setup_tracing("gateway", config.tracing, config.otlp_endpoint)
        upstream = Upstream(config)
        app.state.upstream = upstream
        app.state.response_store = ResponseStore(config.redis_url, config.response_ttl_s)
        app.state.background = BackgroundResponses(
            app.state.response_store,
            app.state.gateway,
            lambda job: responses_api.background_pipeline(job, app.state.response_store),
            lambda tenant: background_context(app, tenant),
        )
        app.state.background.start()
        app.state.budgets = tenant_budgets(config)
        settle_heap()  # start-up is over: modules and app live as long as the process
        try:
            yield
        finally:
            await app.state.background.close()
            await upstream.close()
            await app.state.response_store.close()
            await app.state.budgets.close()
            await tracing.flush_tracing()

    app = FastAPI(
        title="meshserve gateway",
        version=VERSION,
        description="OpenAI-compatible API of the meshserve LLM mesh.",
        lifespan=lifespan,
    )
    state = GatewayState()
    app.state.config = config
    app.state.classes = priority_classes(config)
    app.state.gateway = state
    app.state.started = int(time.time())
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unhandled_error_handler)
    direct = {path: DirectRoute.of(endpoint, response) for path, endpoint, response, _ in _GENERATION_ROUTES}
    app.add_middleware(GatewayMiddleware, config=config, state=state, direct=direct)
    _add_generation_routes(app)
    _add_agent_routes(app)
    _add_model_routes(app)
    if config.enable_lora_updating:
        _add_lora_routes(app)
    _add_tokenizer_routes(app)
    _add_ops_routes(app)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 responses: validation errors are answered 400
    with an ErrorResponse body (declared on every route that validates a body)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


# The generation endpoints: path, endpoint, response model, summary. The gateway
# middleware serves their well-formed requests itself (gateway.direct_routes).
_GENERATION_ROUTES: tuple[tuple[str, Any, Any, str], ...] = (
    ("/v1/chat/completions", chat.create_chat_completion, ChatCompletionResponse, "Create a chat completion"),
    ("/v1/completions", completions.create_completion, CompletionResponse, "Create a completion"),
)


def _add_generating_route(
    app: FastAPI, path: str, endpoint: Any, summary: str, response_model: Any = None
) -> None:
    """A POST endpoint that generates: answered in JSON, or with `stream: true` in SSE
    events, with the errors of a generation."""
    app.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        response_model=response_model,
        responses={200: _SSE, **_GENERATION_ERRORS},
        summary=summary,
    )


def _add_generation_routes(app: FastAPI) -> None:
    for path, endpoint, response_model, summary in _GENERATION_ROUTES:
        _add_generating_route(app, path, endpoint, summary, response_model)
    app.add_api_route(
        "/v1/embeddings",
        create_embeddings,
        methods=["POST"],
        response_model=EmbeddingResponse,
        responses=_GENERATION_ERRORS,
        summary="Create embeddings",
    )


def _add_agent_routes(app: FastAPI) -> None:
    """The Responses API (gateway.responses_api) and Anthropic's Messages API
    (gateway.messages_api), both on the chat path."""
    _add_generating_route(
        app, "/v1/responses", responses_api.create_response, "Create a model response (OpenAI Responses API)"
    )
    for method, path, endpoint, summary in (
        (
            "GET",
            "",
            responses_api.retrieve_response,
            "Get a stored model response (stream a background one again)",
        ),
        ("DELETE", "", responses_api.delete_response, "Delete a stored model response"),
        ("POST", "/cancel", responses_api.cancel_response, "Cancel a background model response"),
    ):
        app.add_api_route(
            "/v1/responses/{response_id}" + path,
            endpoint,
            methods=[method],
            responses=_errors(400, 404, *_COMMON),
            summary=summary,
        )
    _add_generating_route(
        app,
        "/v1/messages",
        messages_api.create_message,
        "Create a message (Anthropic Messages API; errors in Anthropic's shape)",
    )
    app.add_api_route(
        "/v1/messages/count_tokens",
        messages_api.count_tokens,
        methods=["POST"],
        responses=_errors(400, 404, 413, *_COMMON),
        summary="Count a message request's input tokens (Anthropic Messages API)",
    )


def _add_model_routes(app: FastAPI) -> None:
    app.add_api_route(
        "/v1/models", list_models, methods=["GET"], response_model=ModelList, responses=_errors(*_COMMON)
    )
    app.add_api_route(
        "/v1/models/{model:path}",
        retrieve_model,
        methods=["GET"],
        response_model=ModelCard,
        responses=_errors(404, *_COMMON),
    )


def _add_lora_routes(app: FastAPI) -> None:
    for path, endpoint in (
        ("/v1/load_lora_adapter", load_lora_adapter),
        ("/v1/unload_lora_adapter", unload_lora_adapter),
    ):
        app.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_class=PlainTextResponse,
            responses=_errors(400, 403, 404),
            summary=endpoint.__doc__,
        )


def _add_tokenizer_routes(app: FastAPI) -> None:
    errors = _errors(400, 404, 413, *_COMMON)
    app.add_api_route(
        "/tokenize", tokenize, methods=["POST"], response_model=TokenizeResponse, responses=errors
    )
    app.add_api_route(
        "/detokenize", detokenize, methods=["POST"], response_model=DetokenizeResponse, responses=errors
    )


def _add_ops_routes(app: FastAPI) -> None:
    app.add_api_route(
        "/health",
        health,
        methods=["GET"],
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "A component is down, or draining"}},
        summary="Readiness of the gateway and the mesh behind it",
    )
    app.add_api_route(
        "/metrics",
        prometheus_metrics,
        methods=["GET"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}},
        summary="Prometheus metrics of the gateway process",
    )


def _upstream(request: Request) -> Upstream:
    upstream: Upstream = request.app.state.upstream
    return upstream


async def _model_cards(request: Request) -> list[ModelCard]:
    reply = await _upstream(request).list_workers()
    lengths: dict[str, int] = {}
    for status in reply.workers:
        worker = status.worker
        lengths[worker.model] = max(lengths.get(worker.model, 0), worker.max_model_len)
    created = int(request.app.state.started)
    parents = adapter_parents(reply)  # a LoRA adapter's card names its base model (vLLM)
    cards = []
    for model in reply.models:
        base = parents.get(model)
        cards.append(
            ModelCard(
                id=model,
                created=created,
                root=model,
                parent=base,
                max_model_len=lengths.get(base or model) or None,
            )
        )
    return cards


async def list_models(request: Request) -> ModelList:
    """Models served by the mesh (the scheduler's ListWorkers, cached ~1 s)."""
    return ModelList(data=await _model_cards(request))


async def retrieve_model(model: str, request: Request) -> ModelCard:
    """One served model, or 404."""
    for card in await _model_cards(request):
        if card.id == model:
            return card
    raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _encode_embedding(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """Embeddings of text inputs via the scheduler's Embed."""
    upstream = _upstream(request)
    texts = body.texts()
    model = await upstream.resolve_model(body.model, role="embedding")
    embed = common_pb2.EmbedRequest(
        request_id=new_id("embd"),
        model=model,
        inputs=texts,
        normalize=body.normalize,
        truncate_prompt_tokens=body.truncate_prompt_tokens or 0,
    )
    with tracing.span("gateway.embeddings", model=model):
        reply = await upstream.embed(embed)
    data = [
        EmbeddingData(index=i, embedding=_encode_embedding(list(e.values), body.encoding_format))
        for i, e in enumerate(reply.embeddings)
    ]
    usage = EmbeddingUsage(prompt_tokens=reply.prompt_tokens, total_tokens=reply.prompt_tokens)
    return EmbeddingResponse(data=data, model=model, usage=usage)


async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """vLLM /tokenize: a prompt (Tokenize) or chat messages (RenderChat)."""
    body.check()
    upstream = _upstream(request)
    model = await upstream.resolve_model(body.model)
    info = await upstream.tokenizer_info(model)
    if body.messages is not None:
        ids = await _render_for_tokenize(upstream, body, model)
        strs = None
        if body.return_token_strs:
            table = await upstream.token_strings(model, set(ids))
            strs = [table[i] for i in ids]
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=strs)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    reply = await upstream.call(
        TOKENIZER,
        upstream.tokenizer.Tokenize(
            tokenizer_pb2.TokenizeRequest(
                model=upstream.tokenizer_model(model),
                text=body.prompt or "",
                add_special_tokens=add_special,
                return_token_strs=body.return_token_strs,
            ),
            timeout=upstream.timeout,
        ),
    )
    ids = list(reply.token_ids)
    return TokenizeResponse(
        count=len(ids),
        max_model_len=reply.max_model_len or info.max_model_len,
        tokens=ids,
        token_strs=list(reply.token_strs) if body.return_token_strs else None,
    )


async def _render_for_tokenize(upstream: Upstream, body: TokenizeRequest, model: str) -> list[int]:
    messages = [m.model_dump(exclude_unset=True) for m in body.messages or []]
    render = tokenizer_pb2.RenderChatRequest(
        model=upstream.tokenizer_model(model),
        messages_json=json.dumps(messages, ensure_ascii=False),
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        add_special_tokens=bool(body.add_special_tokens),
    )
    if body.tools:
        render.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in body.tools])
    if body.chat_template is not None:
        render.chat_template = body.chat_template
    if body.chat_template_kwargs:
        render.chat_template_kwargs_json = json.dumps(body.chat_template_kwargs)
    reply = await upstream.call(TOKENIZER, upstream.tokenizer.RenderChat(render, timeout=upstream.timeout))
    return list(reply.prompt_token_ids)


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """vLLM /detokenize: token ids → text."""
    upstream = _upstream(request)
    model = await upstream.resolve_model(body.model)
    reply = await upstream.call(
        TOKENIZER,
        upstream.tokenizer.Detokenize(
            tokenizer_pb2.DetokenizeRequest(model=upstream.tokenizer_model(model), token_ids=body.tokens),
            timeout=upstream.timeout,
        ),
    )
    return DetokenizeResponse(prompt=reply.text)


async def health(request: Request) -> JSONResponse:
    """200 only when the tokenizer and scheduler are SERVING and a decoder worker is healthy."""
    report = await _upstream(request).health()
    draining = bool(request.app.state.gateway.draining)
    components: dict[str, str | int] = {
        "gateway": "draining" if draining else "ok",
        "tokenizer": "ok" if report.tokenizer else "down",
        "scheduler": "ok" if report.scheduler else "down",
        "decoder_workers": report.decoder_workers,
    }
    ok = report.ok and not draining
    detail = "; ".join(filter(None, ["gateway is draining" if draining else "", report.detail]))
    body = HealthResponse(status="ok" if ok else "unavailable", components=components, message=detail or None)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


async def prometheus_metrics() -> Response:
    """Prometheus text exposition of this process's metrics."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
