"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (declared only with ``--enable-lora-updating``; allowed
only to a key of ``--admin-api-keys``).

A load goes to every healthy decoder worker (the adapter must fit their base model); if
one refuses it (a corrupt or mismatched directory: 400 naming it), the workers that took
it unload it again, so a refused load changes nothing. The adapter becomes a served model
once the workers' next heartbeats reach the scheduler (about a heartbeat interval).
"""

from __future__ import annotations

import asyncio
import hmac

import grpc
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from gateway.errors import APIError, from_rpc_error
from gateway.upstream import Upstream, adapter_parents
from meshserve.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc
from services.rpc import open_channel

__all__ = ["LoadLoraAdapterRequest", "UnloadLoraAdapterRequest", "load_lora_adapter", "unload_lora_adapter"]

WORKER = "worker"
_CALL_TIMEOUT_S = 60.0


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (its `model` in requests) and its directory on the workers."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body: the adapter to unload."""

    lora_name: str = Field(min_length=1)


def _check_admin(request: Request) -> None:
    keys: tuple[str, ...] = request.app.state.config.admin_api_keys
    header = request.headers.get("authorization") or ""
    given = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
    if not given or not any(hmac.compare_digest(given, key.encode()) for key in keys):
        raise APIError(
            403, "Loading and unloading LoRA adapters needs an admin API key.", code="permission_denied"
        )


def _decoders(workers: scheduler_pb2.ListWorkersResponse) -> list[scheduler_pb2.WorkerStatus]:
    return [
        s
        for s in workers.workers
        if s.worker.role == worker_pb2.WORKER_ROLE_DECODER and s.healthy and not s.draining
    ]


async def _on_worker(address: str, call: str, message: object, max_bytes: int) -> worker_pb2.LoraState:
    async with open_channel(address, max_bytes) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        reply: worker_pb2.LoraState = await getattr(stub, call)(message, timeout=_CALL_TIMEOUT_S)
        return reply


async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """Loads an adapter on every decoder worker, or on none (see module docstring)."""
    _check_admin(request)
    upstream: Upstream = request.app.state.upstream
    workers = await upstream.list_workers(max_age_s=0)
    if body.lora_name in workers.models:
        raise APIError(
            400,
            f"The lora adapter '{body.lora_name}' has already been loaded.",
            param="lora_name",
            code="invalid_value",
        )
    decoders = _decoders(workers)
    if not decoders:
        raise APIError(503, "no healthy decoder worker to load the adapter on", code="unavailable")
    max_bytes = upstream.config.max_grpc_message_bytes
    message = worker_pb2.LoadLoraRequest(name=body.lora_name, path=body.lora_path)
    results = await asyncio.gather(
        *(_on_worker(s.worker.address, "LoadLora", message, max_bytes) for s in decoders),
        return_exceptions=True,
    )
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        undo = worker_pb2.UnloadLoraRequest(name=body.lora_name)
        took = [s for s, r in zip(decoders, results, strict=True) if not isinstance(r, BaseException)]
        await asyncio.gather(
            *(_on_worker(s.worker.address, "UnloadLora", undo, max_bytes) for s in took),
            return_exceptions=True,
        )
        if isinstance(failure, grpc.aio.AioRpcError):
            raise from_rpc_error(failure, WORKER) from failure
        raise failure
    await _until_listed(upstream, body.lora_name, listed=True)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """Unloads an adapter from every worker that has it; 404 naming it when none has."""
    _check_admin(request)
    upstream: Upstream = request.app.state.upstream
    workers = await upstream.list_workers(max_age_s=0)
    if body.lora_name not in adapter_parents(workers):
        raise APIError(
            404,
            f"The lora adapter '{body.lora_name}' cannot be found.",
            param="lora_name",
            code="model_not_found",
        )
    holders = [s for s in workers.workers if body.lora_name in s.loras.loaded and s.healthy]
    message = worker_pb2.UnloadLoraRequest(name=body.lora_name)
    max_bytes = upstream.config.max_grpc_message_bytes
    try:
        await asyncio.gather(
            *(_on_worker(s.worker.address, "UnloadLora", message, max_bytes) for s in holders)
        )
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, WORKER) from exc
    await _until_listed(upstream, body.lora_name, listed=False)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _until_listed(upstream: Upstream, name: str, listed: bool, timeout_s: float = 10.0) -> None:
    """Waits (bounded) until the scheduler's model list agrees, so that the client's next
    request finds the adapter (or not): the workers report it in their next heartbeat."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (name in (await upstream.list_workers(max_age_s=0)).models) != listed:
        if asyncio.get_running_loop().time() > deadline:
            return
        await asyncio.sleep(0.05)
