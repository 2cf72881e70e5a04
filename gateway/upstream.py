"""Clients of the upstream services, created at start-up: the tokenizer service, the
scheduler replicas (routes and releases on each one's RouteStream, ListWorkers, Embed;
failing over between replicas), the gateway's streams to the workers (`WorkerStreams`)
and the in-process tokenizers (files fetched once from the tokenizer service).

Also the small caches every request uses: the model list (ListWorkers, ~1 s) and
tokenizer info per model (max_model_len).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.errors import APIError, from_rpc_error
from gateway.local_tokenizer import GatewayTokenizers
from gateway.route_stream import RouteStream
from gateway.worker_streams import WorkerStreams
from meshserve.v1 import (
    common_pb2,
    kv_transfer_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
    worker_pb2,
)
from services.clock import Clock
from services.rpc import open_channel
from services.worker_roles import role_name

T = TypeVar("T")
log = logging.getLogger(__name__)

TOKENIZER = "tokenizer"
SCHEDULER = "scheduler"
HEALTH_TIMEOUT_S = 1.0
# Leases ended within this window go back to their scheduler in one message.
RELEASE_BATCH_S = 0.02


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


@dataclass(frozen=True)
class LeaseGrant:
    """A scheduler's lease on a worker for one request (a route's answer)."""

    lease_id: str
    worker_id: str
    worker_address: str
    mm_items: list[common_pb2.MultiModalItem]
    replica: int  # index of the scheduler replica that issued it (its release goes there)
    # P/D: the prefill worker the decoder pulls the prompt's KV from (unset: none); its
    # lease ends with this one on the scheduler.
    kv_source: kv_transfer_pb2.KvSource | None = None


def _answers(workers: scheduler_pb2.ListWorkersResponse, model: str | None, role: str) -> bool:
    """True when the list can answer a request for `model`: it serves the model, or,
    when none is named, a healthy worker of `role` serves one."""
    return model in workers.models if model else _first_model_of(workers, role) is not None


def _first_model_of(workers: scheduler_pb2.ListWorkersResponse, role: str) -> str | None:
    """The model of the first healthy, not draining worker of `role` in the list."""
    for status in workers.workers:
        if role_name(status.worker.role) == role and status.healthy and not status.draining:
            return status.worker.model
    return None


def adapter_parents(workers: scheduler_pb2.ListWorkersResponse) -> dict[str, str]:
    """Each LoRA adapter a worker has loaded -> that worker's (base) model."""
    return {name: status.worker.model for status in workers.workers for name in status.loras.loaded}


class _Replica:
    """One scheduler replica: channel, stubs, and leases waiting to be released."""

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.address = address
        self.channel = open_channel(address, max_message_bytes)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.routes = RouteStream(self.stub, address)
        self.pending_release: list[str] = []
        # Leases released with their usage (ReleaseRequest.outcomes), for the scheduler's
        # predicted-vs-actual cached tokens.
        self.pending_outcomes: list[scheduler_pb2.LeaseOutcome] = []

    def take_releases(self) -> scheduler_pb2.ReleaseRequest | None:
        """The leases waiting to be released here (now handed over), or None."""
        if not self.pending_release and not self.pending_outcomes:
            return None
        release = scheduler_pb2.ReleaseRequest(lease_ids=self.pending_release, outcomes=self.pending_outcomes)
        self.pending_release, self.pending_outcomes = [], []
        return release


class Upstream:
    """gRPC stubs of the tokenizer, the scheduler replicas and the workers, plus the
    caches built on them."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.timeout = config.request_timeout_s
        self._tok_channel = open_channel(config.tokenizer_address, config.max_grpc_message_bytes)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self._tok_channel)
        self._tok_health = health_pb2_grpc.HealthStub(self._tok_channel)
        addresses = [a.strip() for a in config.scheduler_address.split(",") if a.strip()]
        self._replicas = [_Replica(a, config.max_grpc_message_bytes) for a in addresses]
        self._next_replica = itertools.cycle(range(len(self._replicas)))
        self.workers = WorkerStreams(config.max_grpc_message_bytes)
        cache_root = Path(config.tokenizer_cache_dir or Path(tempfile.gettempdir()) / "meshserve-tokenizers")
        # LoRA adapter -> its base model, from the latest worker list.
        self._adapter_parents: dict[str, str] = {}
        self.tokenizers = GatewayTokenizers(self.tokenizer, cache_root, self.timeout, self.tokenizer_model)
        self._workers: scheduler_pb2.ListWorkersResponse | None = None
        self._workers_at = 0.0
        self.clock: Clock = time.monotonic  # the worker list's age (`models_cache_s`)
        self._workers_lock = asyncio.Lock()
        self._workers_refresh: asyncio.Task[None] | None = None
        self._infos: dict[str, tokenizer_pb2.TokenizerInfo] = {}
        self._release_handle: asyncio.TimerHandle | None = None
        self._usage: dict[str, scheduler_pb2.LeaseOutcome] = {}  # lease id -> outcome, until released

    async def close(self) -> None:
        """Releases pending leases, then closes every stream and channel (in-flight
        calls are cancelled)."""
        self._flush_releases()
        if self._workers_refresh is not None:
            self._workers_refresh.cancel()
        await self.workers.close()
        await self._tok_channel.close()
        for replica in self._replicas:
            await replica.routes.close()
            await replica.channel.close()

    # -- scheduler replicas -----------------------------------------------------------

    async def on_scheduler(
        self,
        call: Callable[[scheduler_pb2_grpc.SchedulerStub], Awaitable[T]],
        short_deadline: bool = False,
    ) -> tuple[T, int]:
        """Runs a unary scheduler call on the next replica, trying the others when one
        is unreachable; returns the reply and the replica index. All unreachable → 503.
        With `short_deadline` (the call's deadline is the gateway's own, not the
        client's), a replica that does not answer in time counts as unreachable."""
        return await self._on_replicas(lambda replica: call(replica.stub), short_deadline)

    async def _on_replicas(
        self, call: Callable[[_Replica], Awaitable[T]], short_deadline: bool = False
    ) -> tuple[T, int]:
        first = next(self._next_replica)
        failover = {grpc.StatusCode.UNAVAILABLE}
        if short_deadline:
            failover.add(grpc.StatusCode.DEADLINE_EXCEEDED)
        error: grpc.aio.AioRpcError | None = None
        for index in self._replica_order(first):
            try:
                return await call(self._replicas[index]), index
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in failover:
                    raise from_rpc_error(exc, SCHEDULER) from exc
                error = exc
        if error is None:  # no replica configured (the config refuses this)
            raise APIError(503, "scheduler: none configured", code="unavailable")
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # hung, not a client timeout
            raise APIError(503, "scheduler: no replica answered in time", code="unavailable") from error
        raise from_rpc_error(error, SCHEDULER) from error

    def _replica_order(self, first: int) -> list[int]:
        """Replica indexes starting at `first`, those whose channel is failing or still
        connecting last: a hung replica (its connection lost to keepalive, reconnects
        timing out) would make every call that tries it first wait for the timeout."""
        count = len(self._replicas)
        order = [(first + offset) % count for offset in range(count)]
        failing = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.CONNECTING)
        return sorted(order, key=lambda i: self._replicas[i].channel.get_state() in failing)

    async def route(
        self, request: common_pb2.GenerateRequest, exclude: list[str], force_encode: bool
    ) -> LeaseGrant:
        """A lease on the worker the scheduler picks for `request`, over the replica's
        RouteStream (`gateway.route_stream`)."""
        message = scheduler_pb2.RouteStreamRequest(
            route=scheduler_pb2.RouteRequest(
                request=request, exclude_worker_ids=exclude, force_encode=force_encode
            )
        )

        def call(replica: _Replica) -> Awaitable[scheduler_pb2.RouteResponse]:
            # Leases ended since the last route ride along (fewer messages under load).
            message.ClearField("release")
            release = replica.take_releases()
            if release is not None:
                message.release.CopyFrom(release)
            return replica.routes.route(message, self.timeout)

        reply, replica = await self._on_replicas(call)
        kv_source = reply.kv_source if reply.HasField("kv_source") else None
        return LeaseGrant(
            reply.lease_id, reply.worker_id, reply.worker_address, list(reply.mm_items), replica, kv_source
        )

    def note_usage(self, lease: LeaseGrant, usage: common_pb2.Usage) -> None:
        """Remembers what the worker reported for the lease's request; its release then
        carries the actual cached tokens (the scheduler compares them with its prediction)."""
        self._usage[lease.lease_id] = scheduler_pb2.LeaseOutcome(
            lease_id=lease.lease_id, cached_tokens=usage.cached_tokens, prompt_tokens=usage.prompt_tokens
        )

    def release(self, lease: LeaseGrant) -> None:
        """Hands a lease back to the replica that issued it (batched, in the background),
        with its outcome when `note_usage` recorded one."""
        replica = self._replicas[lease.replica]
        outcome = self._usage.pop(lease.lease_id, None)
        if outcome is None:
            replica.pending_release.append(lease.lease_id)
        else:
            replica.pending_outcomes.append(outcome)
        self._schedule_release()

    def _schedule_release(self) -> None:
        if self._release_handle is None:
            loop = asyncio.get_running_loop()
            self._release_handle = loop.call_later(RELEASE_BATCH_S, self._schedule_flush)

    def _schedule_flush(self) -> None:
        self._release_handle = None
        self._flush_releases()

    def _flush_releases(self) -> None:
        # Leases no route carried within the batch window go on their own message. When
        # the replica is gone they are lost with its stream, and end with its workers'
        # heartbeats (or at their TTL).
        for replica in self._replicas:
            release = replica.take_releases()
            if release is not None:
                replica.routes.release(release)

    async def call(self, component: str, awaitable: Awaitable[T]) -> T:
        """Awaits a unary call, mapping a gRPC failure to an APIError."""
        try:
            return await awaitable
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, component) from exc

    async def list_workers(self, max_age_s: float | None = None) -> scheduler_pb2.ListWorkersResponse:
        """The scheduler's ListWorkers, reused for `models_cache_s` (single flight)."""
        max_age = self.config.models_cache_s if max_age_s is None else max_age_s
        cached = self._fresh_workers(max_age)
        if cached is not None:
            return cached
        async with self._workers_lock:
            cached = self._fresh_workers(max_age)
            if cached is not None:
                return cached
            reply, _ = await self.on_scheduler(
                lambda stub: stub.ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=HEALTH_TIMEOUT_S * 5
                ),
                short_deadline=True,
            )
            self._workers, self._workers_at = reply, self.clock()
            self._adapter_parents = adapter_parents(reply)
            return reply

    def tokenizer_model(self, model: str) -> str:
        """The model whose tokenizer `model` uses: a LoRA adapter's base model, else itself."""
        return self._adapter_parents.get(model, model)

    def _fresh_workers(self, max_age_s: float) -> scheduler_pb2.ListWorkersResponse | None:
        """The cached worker list when it is younger than `max_age_s`, else None."""
        if self._workers is not None and self.clock() - self._workers_at < max_age_s:
            return self._workers
        return None

    async def resolve_model(self, model: str | None, role: str = "decoder") -> str:
        """The served model a request names -- or, when it names none, the first model a
        healthy worker of `role` serves (a mesh serving an embedding model beside its
        language model must not answer a completion with the embedding model); 404 if
        unknown.

        A model the cached list has is answered from it at once, however old the list:
        a stale one is refreshed in the background, never on the request's path (at a
        request every second, waiting for ListWorkers put a scheduler round trip before
        routing on most requests). Only a model the list lacks waits for a list at most
        `models_cache_s` old before it is refused, so a model whose workers just
        registered is not turned away by an old list; so does a request naming no model
        when the list has no healthy worker of `role` (only other kinds of workers)."""
        cached = self._workers
        if cached is not None and _answers(cached, model, role):
            self._refresh_workers_in_background()
        else:
            cached = await self.list_workers()
        models = list(cached.models)
        if not models:
            raise APIError(503, "no model is being served (no healthy worker yet)", code="unavailable")
        if model is None or model == "":
            default = _first_model_of(cached, role)
            if default is None:
                raise APIError(503, f"no {role} worker is serving a model yet", code="unavailable")
            return default
        if model not in models:
            raise APIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return model

    def _refresh_workers_in_background(self) -> None:
        """Starts one ListWorkers refresh when the cached list is older than
        `models_cache_s` and none is running (a failure only logs: the next request
        whose model the list lacks tries again, on its own path)."""
        if self._workers_refresh is not None or self._fresh_workers(self.config.models_cache_s) is not None:
            return

        async def refresh() -> None:
            try:
                await self.list_workers()
            except APIError as exc:
                log.debug("model list refresh failed: %s", exc.message)
            finally:
                self._workers_refresh = None

        self._workers_refresh = asyncio.get_running_loop().create_task(refresh())

    async def tokenizer_info(self, model: str) -> tokenizer_pb2.TokenizerInfo:
        """GetTokenizerInfo, cached per model."""
        cached = self._infos.get(model)
        if cached is not None:
            return cached
        info = await self.call(
            TOKENIZER,
            self.tokenizer.GetTokenizerInfo(
                tokenizer_pb2.GetTokenizerInfoRequest(model=self.tokenizer_model(model)), timeout=self.timeout
            ),
        )
        self._infos[model] = info
        return info

    async def token_strings(self, model: str, ids: set[int]) -> dict[int, str]:
        """Text of single token ids (for logprobs), from the in-process tokenizer."""
        tokenizer = await self.tokenizers.get(model)
        return tokenizer.token_strings(ids)

    async def embed(self, request: common_pb2.EmbedRequest) -> common_pb2.EmbedResponse:
        """Scheduler.Embed on any live replica."""
        reply, _ = await self.on_scheduler(lambda stub: stub.Embed(request, timeout=self.timeout))
        return reply

    async def health(self) -> HealthReport:
        """grpc health of both services and the scheduler's healthy decoder workers."""
        tok, sched, workers = await asyncio.gather(
            self._serving(self._tok_health),
            self._any_scheduler_serving(),
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

    async def _any_scheduler_serving(self) -> bool:
        states = await asyncio.gather(*(self._serving(r.health) for r in self._replicas))
        return any(states)

    async def _decoder_count(self) -> int:
        """Healthy, non-draining decoder workers (-1 when no scheduler can answer). Their
        models' tokenizers start loading now (no wait), so that a first request after the
        mesh reports ready rarely waits for one."""
        try:
            reply, _ = await self.on_scheduler(
                lambda stub: stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=HEALTH_TIMEOUT_S)
            )
        except APIError:
            return -1
        serving = [
            w.worker
            for w in reply.workers
            if w.healthy and not w.draining and w.worker.role == worker_pb2.WORKER_ROLE_DECODER
        ]
        for model in {w.model for w in serving}:
            self.tokenizers.prefetch(model)
        return len(serving)
