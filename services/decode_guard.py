"""Answers requests whose bytes do not parse as the method's message (corrupt wire
data, invalid UTF-8 in a `string` field) with INVALID_ARGUMENT instead of grpc's
UNKNOWN, before any servicer code runs."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class _Undecodable:
    """Stands in for a request that failed to parse; carries the parser's message."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, UnicodeDecodeError, ...
            return _Undecodable(str(exc) or type(exc).__name__)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {bad.error}")


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        yield request


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = _safe(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async for response in inner_us(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, serialize)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await inner_su(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, parse, serialize)
    inner_ss = handler.stream_stream
    if not inspect.isasyncgenfunction(inner_ss):
        # A handler that writes its responses itself (`context.write`).
        async def stream_stream_writer(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> None:
            await inner_ss(_checked(requests, context), context)

        return grpc.stream_stream_rpc_method_handler(stream_stream_writer, parse, serialize)

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for response in inner_ss(_checked(requests, context), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, parse, serialize)


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Server interceptor wrapping every method's request deserializer (see module doc)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guard(handler)
