"""The meshserve.v1.Scheduler gRPC servicer: proto ↔ domain conversion, nothing more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshserve.v1 import common_pb2, kv_transfer_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from scheduler_svc.registry import LoadSnapshot, WorkerSpec, WorkerState
from scheduler_svc.route import Router
from scheduler_svc.route_stream import RouteStreamCall
from scheduler_svc.scheduler import Scheduler
from services.proto_mirror import fields_of, mirrored
from services.rpc import feed_stream, rpc_handler
from services.worker_roles import role_name, role_value

# The WorkerDescriptor fields a WorkerSpec keeps as they are (the role and the KV layout
# change form on the way).
_SPEC_FIELDS = (
    "worker_id",
    "address",
    "model",
    "max_model_len",
    "block_size",
    "num_total_blocks",
    "max_num_seqs",
)


def _spec_fields(source: scheduler_pb2.WorkerDescriptor | WorkerSpec) -> dict[str, Any]:
    return {name: getattr(source, name) for name in _SPEC_FIELDS}


def spec_from_proto(worker: scheduler_pb2.WorkerDescriptor) -> WorkerSpec:
    return WorkerSpec(
        role=role_name(worker.role or worker_pb2.WORKER_ROLE_DECODER),
        kv_layout=layout_key(worker.kv_layout) if worker.HasField("kv_layout") else "",
        **_spec_fields(worker),
    )


def layout_key(layout: kv_transfer_pb2.KvLayout) -> str:
    """A KV layout as one comparable string (WorkerSpec.kv_layout)."""
    fields = (
        layout.model,
        layout.dtype,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
    )
    return "/".join(str(f) for f in fields)


def load_from_proto(load: worker_pb2.LoadStats, loras: worker_pb2.LoraState | None = None) -> LoadSnapshot:
    return LoadSnapshot(
        lora_loaded=tuple(loras.loaded) if loras is not None else (),
        lora_resident=tuple(loras.resident) if loras is not None else (),
        lora_slots=loras.max_loras if loras is not None else 0,
        **fields_of(worker_pb2.LoadStats, load),
    )


def status_to_proto(state: WorkerState, now: float) -> scheduler_pb2.WorkerStatus:
    spec, load = state.spec, state.load
    return scheduler_pb2.WorkerStatus(
        worker=scheduler_pb2.WorkerDescriptor(role=role_value(spec.role), **_spec_fields(spec)),
        healthy=state.healthy,
        draining=state.draining,
        load=mirrored(worker_pb2.LoadStats, load),
        last_heartbeat_age_s=max(now - state.last_seen, 0.0),
        loras=worker_pb2.LoraState(
            loaded=load.lora_loaded, resident=load.lora_resident, max_loras=load.lora_slots
        ),
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):  # type: ignore[misc]
    """meshserve.v1.Scheduler over a `Scheduler` core."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.router = Router(scheduler)
        self._lease_ttl_ms = int(scheduler.config.lease_ttl_s * 1000)
        self._calls: set[RouteStreamCall] = set()
        self._draining = False

    @rpc_handler
    async def RouteStream(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.RouteStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Routes and releases over one long-lived stream per caller (scheduler.proto).
        Answers are written with `context.write` by whoever has them -- the reader for
        routes answered at once, a route's task for one that waited -- one write at a time."""
        writes = asyncio.Lock()

        async def send(answer: scheduler_pb2.RouteStreamResponse) -> None:
            async with writes:
                await context.write(answer)

        call = RouteStreamCall(self.router, self._lease_ttl_ms, lambda: self._draining, send)
        self._calls.add(call)
        reader = asyncio.create_task(feed_stream(request_iterator, call, "RouteStream"))
        try:
            await call.ended.wait()
        finally:
            reader.cancel()
            call.close()
            self._calls.discard(call)

    async def on_drain(self) -> None:
        """Draining: route streams refuse new routes and end once theirs are answered
        (their callers go to another replica)."""
        self._draining = True
        for call in self._calls:
            call.wake()

    @rpc_handler
    async def Embed(
        self, request: common_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.EmbedResponse:
        """Routes an embedding request to a healthy embedding worker serving its model."""
        return await self.router.embed(request)

    @rpc_handler
    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        """Adds (or, after a restart, replaces) a worker; answers the heartbeat interval."""
        self.scheduler.register(spec_from_proto(request.worker))
        return scheduler_pb2.RegisterWorkerResponse(
            heartbeat_interval_ms=self.scheduler.config.heartbeat_interval_ms
        )

    @rpc_handler
    async def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        """Records a worker's load; known=false tells an unknown worker to register again."""
        if not request.worker_id:
            raise ValueError("worker_id is required")
        known = self.scheduler.heartbeat(
            request.worker_id,
            load_from_proto(request.load, request.loras if request.HasField("loras") else None),
            request.draining,
            request.active_lease_ids,
        )
        return scheduler_pb2.HeartbeatResponse(known=known)

    @rpc_handler
    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        """Every known worker with health, load and heartbeat age; models with a healthy worker."""
        now = self.scheduler.registry.now()
        return scheduler_pb2.ListWorkersResponse(
            workers=[status_to_proto(state, now) for state in self.scheduler.workers()],
            models=self.scheduler.registry.models(healthy_only=True),
        )
