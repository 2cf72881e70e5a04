"""Clients of the upstream services: one gRPC channel each, created at start-up.

Also the small caches every request uses: the model list (ListWorkers, ~1 s),
tokenizer info per model (max_model_len) and token strings for logprobs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.errors import APIError, from_rpc_error
from meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.rpc import open_channel

T = TypeVar("T")

TOKENIZER = "tokenizer"
SCHEDULER = "scheduler"
HEALTH_TIMEOUT_S = 1.0
_TOKEN_STR_CACHE_MAX = 200_000
_TOKEN_STR_CONCURRENCY = 64


@dataclass(frozen=True)
class HealthReport:
    """Readiness of the upstream components, as /health reports it."""

    tokenizer: bool
    scheduler: bool
    decoder_workers: int
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True when requests can be served."""
        return self.tokenizer and self.scheduler and self.decoder_workers > 0


class Upstream:
    """gRPC stubs of the tokenizer and scheduler plus the caches built on them."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.timeout = config.request_timeout_s
        self._tok_channel = open_channel(config.tokenizer_address, config.max_grpc_message_bytes)
        self._sched_channel = open_channel(config.scheduler_address, config.max_grpc_message_bytes)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._tok_channel)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self._sched_channel)
        self._tok_health = health_pb2_grpc.HealthStub(self._tok_channel)
        self._sched_health = health_pb2_grpc.HealthStub(self._sched_channel)
        self._workers: scheduler_pb2.ListWorkersResponse | None = None
        self._workers_at = 0.0
        self._workers_lock = asyncio.Lock()
        self._infos: dict[str, tokenizer_pb2.TokenizerInfo] = {}
        self._token_strs: dict[tuple[str, int], str] = {}
        self._token_sem = asyncio.Semaphore(_TOKEN_STR_CONCURRENCY)

    async def close(self) -> None:
        """Closes both channels (in-flight calls are cancelled)."""
        await self._tok_channel.close()
        await self._sched_channel.close()

    async def call(self, component: str, awaitable: Awaitable[T]) -> T:
        """Awaits a unary call, mapping a gRPC failure to an APIError."""
        try:
            return await awaitable
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, component) from exc

    async def list_workers(self, max_age_s: float | None = None) -> scheduler_pb2.ListWorkersResponse:
        """The scheduler's ListWorkers, reused for `models_cache_s` (single flight)."""
        max_age = self.config.models_cache_s if max_age_s is None else max_age_s
        if self._workers is not None and time.monotonic() - self._workers_at < max_age:
            return self._workers
        async with self._workers_lock:
            if self._workers is not None and time.monotonic() - self._workers_at < max_age:
                return self._workers
            reply = await self.call(
                SCHEDULER,
                self.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=HEALTH_TIMEOUT_S * 5),
            )
            self._workers, self._workers_at = reply, time.monotonic()
            return reply

    async def resolve_model(self, model: str | None) -> str:
        """The served model a request names (or the first one when omitted); 404 if unknown."""
        models = list((await self.list_workers()).models)
        if not models:
            raise APIError(503, "no model is being served (no healthy worker yet)", code="unavailable")
        if model is None or model == "":
            return models[0]
        if model not in models:
            raise APIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return model

    async def tokenizer_info(self, model: str) -> tokenizer_pb2.TokenizerInfo:
        """GetTokenizerInfo, cached per model."""
        cached = self._infos.get(model)
        if cached is not None:
            return cached
        info = await self.call(
            TOKENIZER,
            self.tokenizer.GetTokenizerInfo(
                tokenizer_pb2.GetTokenizerInfoRequest(model=model), timeout=self.timeout
            ),
        )
        self._infos[model] = info
        return info

    async def token_strings(self, model: str, ids: set[int]) -> dict[int, str]:
        """Text of single token ids (for logprobs), via batched Detokenize calls, cached."""
        missing = [i for i in ids if (model, i) not in self._token_strs]
        if missing:
            if len(self._token_strs) + len(missing) > _TOKEN_STR_CACHE_MAX:
                self._token_strs.clear()
            texts = await asyncio.gather(*(self._detokenize_one(model, i) for i in missing))
            for token_id, text in zip(missing, texts, strict=True):
                self._token_strs[(model, token_id)] = text
        return {i: self._token_strs[(model, i)] for i in ids}

    async def _detokenize_one(self, model: str, token_id: int) -> str:
        request = tokenizer_pb2.DetokenizeRequest(
            model=model, token_ids=[token_id], skip_special_tokens=False
        )
        async with self._token_sem:
            reply = await self.call(TOKENIZER, self.tokenizer.Detokenize(request, timeout=self.timeout))
        return reply.text

    async def health(self) -> HealthReport:
        """grpc health of both services and the scheduler's healthy decoder workers."""
        tok, sched, workers = await asyncio.gather(
            self._serving(self._tok_health),
            self._serving(self._sched_health),
            self._decoder_count(),
        )
        detail = []
        if not tok:
            detail.append("tokenizer is not serving")
        if not sched:
            detail.append("scheduler is not serving")
        if workers <= 0:
            detail.append("no healthy decoder worker")
        return HealthReport(tok, sched, max(workers, 0), "; ".join(detail))

    @staticmethod
    async def _serving(stub: health_pb2_grpc.HealthStub) -> bool:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def _decoder_count(self) -> int:
        """Healthy, non-draining decoder workers (-1 when the scheduler cannot answer)."""
        try:
            reply = await self.scheduler.ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return -1
        return sum(1 for w in reply.workers if w.healthy and not w.draining and w.worker.role == "decoder")
