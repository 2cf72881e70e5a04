"""Routes and releases over `Scheduler.RouteStream` as the gateway sends them (the
scheduler has no unary Route or Release), for tests that play the gateway.

`RouteClient` is the gateway's own `RouteStream` to one scheduler. A release on the
stream is answered by nothing, so `ReleaseCounter` (in-process schedulers) tells a test
that awaits its release when the replica handled it, and how many leases it ended."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence

import grpc

from gateway.route_stream import RouteStream
from meshserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.route import Router


class RouteClient:
    """One route stream to one scheduler replica."""

    def __init__(self, channel: grpc.aio.Channel, name: str = "scheduler") -> None:
        self.stream = RouteStream(scheduler_pb2_grpc.SchedulerStub(channel), name)

    async def route(
        self,
        request: common_pb2.GenerateRequest,
        exclude: Iterable[str] = (),
        force_encode: bool = False,
        timeout: float = 20.0,
        release: scheduler_pb2.ReleaseRequest | None = None,
    ) -> scheduler_pb2.RouteResponse:
        """A lease for `request`; a refused route raises a grpc.aio.AioRpcError with its
        code, message and param. Cancelling the await cancels the route on the replica.
        `release` rides on the route's message (the replica handles it first)."""
        route = scheduler_pb2.RouteRequest(
            request=request, exclude_worker_ids=list(exclude), force_encode=force_encode
        )
        message = scheduler_pb2.RouteStreamRequest(route=route, release=release)
        return await self.stream.route(message, timeout)

    def release(self, *lease_ids: str, outcomes: Sequence[scheduler_pb2.LeaseOutcome] = ()) -> None:
        """Releases leases on a message of their own (sent in the background, in order)."""
        self.stream.release(scheduler_pb2.ReleaseRequest(lease_ids=lease_ids, outcomes=outcomes))

    async def close(self) -> None:
        await self.stream.close()


class ReleaseCounter:
    """How many known leases the releases `router` handles end, per release awaited."""

    def __init__(self, router: Router) -> None:
        # The lease ids of an awaited release (outcomes' after lease_ids) -> its waiters.
        self._waiting: dict[tuple[str, ...], deque[asyncio.Future[int]]] = {}
        release = router.release

        def counted(lease_ids: list[str], outcomes: Sequence[scheduler_pb2.LeaseOutcome] = ()) -> int:
            count = release(lease_ids, outcomes)
            waiters = self._waiting.get((*lease_ids, *(o.lease_id for o in outcomes)))
            if waiters:
                waiters.popleft().set_result(count)
            return count

        router.release = counted  # type: ignore[method-assign]

    def expect(
        self, lease_ids: Sequence[str], outcomes: Sequence[scheduler_pb2.LeaseOutcome]
    ) -> asyncio.Future[int]:
        """The count of the next release of exactly these leases the replica handles."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        key = (*lease_ids, *(o.lease_id for o in outcomes))
        self._waiting.setdefault(key, deque()).append(future)
        return future


async def release_counted(
    client: RouteClient,
    counter: ReleaseCounter,
    *lease_ids: str,
    outcomes: Sequence[scheduler_pb2.LeaseOutcome] = (),
    timeout: float = 10.0,
) -> int:
    """Releases on `client`'s stream and waits until the replica handled it: how many of
    the leases it knew and ended (unknown or already ended ones count 0)."""
    handled = counter.expect(lease_ids, outcomes)
    client.release(*lease_ids, outcomes=outcomes)
    return await asyncio.wait_for(handled, timeout)
