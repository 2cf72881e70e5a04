"""Leases handed out by `Scheduler.Route`: which request holds a slot on which worker.

The scheduler no longer sees a request's stream, so it learns that a request ended in
one of three ways, whichever comes first:

* the caller releases the lease (`Scheduler.Release`, sent by the gateway at the end);
* the worker's heartbeats have not listed the lease among the requests it runs for a
  grace period since it was issued or last listed (the gateway died, or its Release was
  lost). The grace covers a fresh lease whose request is on its way to the worker, and a
  granted lease a gateway keeps between the requests it reuses it for;
* the lease's TTL passes (a worker that never reports leases, or a lost worker).

Domain code: no grpc.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler_svc.registry import Lease


@dataclass(eq=False)
class ActiveLease:
    """A lease with its id, request and deadline."""

    lease_id: str
    request_id: str
    lease: Lease
    issued_at: float
    expires_at: float
    # Prompt tokens the policy expected the worker to have cached (compared with the
    # actual figure the caller may report on release).
    predicted_cached_tokens: int = 0
    # When its worker last reported it running (issued_at until then).
    seen_at: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.lease.worker.worker_id


class LeaseTable:
    """Leases of this scheduler replica by id; popping one hands its slot back."""

    def __init__(
        self, ttl_s: float, grace_s: float, clock: Callable[[], float], replica_id: str = ""
    ) -> None:
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self._clock = clock
        # Lease ids: this replica's random id (operators can tell who issued one, and a
        # restarted replica never reuses an id) + a counter (cheaper than a uuid each).
        self._prefix = (replica_id or uuid.uuid4().hex[:12]) + "-"
        self._counter = itertools.count(1)
        self._leases: dict[str, ActiveLease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def issue(self, lease: Lease, request_id: str, predicted_cached_tokens: int = 0) -> ActiveLease:
        """Records a new lease and returns it."""
        now = self._clock()
        active = ActiveLease(
            f"{self._prefix}{next(self._counter)}", request_id, lease, now, now + self.ttl_s,
            predicted_cached_tokens, seen_at=now,
        )  # fmt: skip
        self._leases[active.lease_id] = active
        return active

    def release(self, lease_ids: Iterable[str]) -> list[ActiveLease]:
        """Ends the given leases; unknown (or already ended) ids are ignored."""
        return [lease for lease_id in lease_ids if (lease := self._leases.pop(lease_id, None)) is not None]

    def reconcile(self, worker_id: str, active_ids: Iterable[str]) -> list[ActiveLease]:
        """Renews the worker's leases it reports running (their TTL starts again) and ends
        those it has not reported for the grace period (since issued or last reported)."""
        running = set(active_ids)
        now = self._clock()
        ended = []
        for lease in self._leases.values():
            if lease.worker_id != worker_id:
                continue
            if lease.lease_id in running:
                lease.expires_at = now + self.ttl_s
                lease.seen_at = now
            elif lease.seen_at <= now - self.grace_s:
                ended.append(lease)
        return self.release(lease.lease_id for lease in ended)

    def expire(self) -> list[ActiveLease]:
        """Ends the leases past their TTL."""
        now = self._clock()
        return self.release([lease.lease_id for lease in self._leases.values() if lease.expires_at <= now])

    def of_worker(self, worker_id: str) -> list[ActiveLease]:
        """Ends every lease of a worker (it is gone)."""
        return self.release(
            [lease.lease_id for lease in self._leases.values() if lease.worker_id == worker_id]
        )
