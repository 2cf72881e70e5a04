"""The leases this scheduler replica handed out on route answers: which request holds a
slot on which worker, and where each lease is in its life.

A lease is ISSUED when its route is answered and RUNNING once its worker's heartbeat
lists it. The scheduler does not see the request's stream, so it learns that the request
ended in one of four ways, whichever comes first -- each an end state of the lease:

* RELEASED: the gateway released it on its route stream (the normal end);
* RECONCILED: its worker's heartbeats have not listed it for a grace period since it was
  issued or last listed (the gateway died, or its release was lost). The grace covers an
  ISSUED lease whose request is still on its way to the worker, and a RUNNING one whose
  release -- batched, carrying the request's outcome -- comes after the worker's next
  heartbeat: `reconciled` then counts only lost releases;
* EXPIRED: its TTL passed with no report (a worker that never reports leases);
* WORKER_DOWN: its worker was marked down (the request is lost with it).

Ending a lease pops it from the table, so each ends once and hands its slot back once.

Domain code: no grpc.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from scheduler_svc.registry import Lease
from services.clock import Clock


class LeaseState(StrEnum):
    """Where a lease is; the end states name how it ended (LEASES_ENDED's `how`)."""

    ISSUED = "issued"
    RUNNING = "running"
    RELEASED = "released"
    RECONCILED = "reconciled"
    EXPIRED = "expired"
    WORKER_DOWN = "worker_down"


_ENDS = frozenset({LeaseState.RELEASED, LeaseState.RECONCILED, LeaseState.EXPIRED, LeaseState.WORKER_DOWN})
# The allowed moves; an end state allows none.
_NEXT = {
    LeaseState.ISSUED: _ENDS | {LeaseState.RUNNING},
    LeaseState.RUNNING: _ENDS | {LeaseState.RUNNING},
}


@dataclass(eq=False)
class LeaseRecord:
    """A lease with its id, request, deadline and state."""

    lease_id: str
    request_id: str
    lease: Lease
    issued_at: float
    expires_at: float
    # Prompt tokens the policy expected the worker to have cached (compared with the
    # actual figure the caller may report on release).
    predicted_cached_tokens: int = 0
    state: LeaseState = LeaseState.ISSUED
    # When its worker last listed it (issued_at until then).
    seen_at: float = 0.0
    # Prompt tokens its worker is to compute for this route, counted in the worker's
    # `routed_prompt_tokens` while the lease is ISSUED: once the worker lists it, the
    # worker's own reports count them (pd.py).
    prompt_tokens: int = 0

    @property
    def worker_id(self) -> str:
        return self.lease.worker.worker_id

    def route_prompt_tokens(self, tokens: int) -> None:
        """Counts ``tokens`` more prompt tokens for its worker to compute (see above)."""
        if self.state is LeaseState.ISSUED:
            self.prompt_tokens += tokens
            self.lease.worker.routed_prompt_tokens += tokens

    def move(self, to: LeaseState) -> None:
        """Moves to `to`; a move the lifecycle does not allow is a bug (ValueError)."""
        if to not in _NEXT.get(self.state, ()):
            raise ValueError(f"lease {self.lease_id}: {self.state} -> {to} is not allowed")
        if self.state is LeaseState.ISSUED and self.prompt_tokens:
            self.lease.worker.routed_prompt_tokens -= self.prompt_tokens
            self.prompt_tokens = 0
        self.state = to


class LeaseTable:
    """The live (ISSUED or RUNNING) leases of this replica by id."""

    def __init__(self, ttl_s: float, grace_s: float, clock: Clock, replica_id: str = "") -> None:
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self._clock = clock
        # Lease ids: this replica's random id (operators can tell who issued one, and a
        # restarted replica never reuses an id) + a counter (cheaper than a uuid each).
        self._prefix = (replica_id or uuid.uuid4().hex[:12]) + "-"
        self._counter = itertools.count(1)
        self._leases: dict[str, LeaseRecord] = {}
        # A decode lease -> the prefill worker's lease issued with it (P/D): one ends with it.
        self._companions: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: str) -> LeaseRecord | None:
        """The live lease of that id, or None (unknown or ended)."""
        return self._leases.get(lease_id)

    def issue(self, lease: Lease, request_id: str, predicted_cached_tokens: int = 0) -> LeaseRecord:
        """Records a new ISSUED lease and returns it."""
        now = self._clock()
        record = LeaseRecord(
            f"{self._prefix}{next(self._counter)}", request_id, lease, now, now + self.ttl_s,
            predicted_cached_tokens, seen_at=now,
        )  # fmt: skip
        self._leases[record.lease_id] = record
        return record

    def link(self, lease_id: str, companion_id: str) -> None:
        """``companion_id`` ends (the same way) when ``lease_id`` ends, if not before."""
        self._companions[lease_id] = companion_id

    def release(self, lease_ids: Iterable[str]) -> list[LeaseRecord]:
        """Ends the given leases (RELEASED); unknown (or already ended) ids are ignored."""
        return self._end(lease_ids, LeaseState.RELEASED)

    def reconcile(self, worker_id: str, active_ids: Iterable[str]) -> list[LeaseRecord]:
        """One heartbeat of `worker_id`: the leases it lists are RUNNING (their TTL starts
        again); those it has not listed for the grace period (since issued or last
        listed) end RECONCILED."""
        running = set(active_ids)
        now = self._clock()
        ended = []
        for record in self._leases.values():
            if record.worker_id != worker_id:
                continue
            if record.lease_id in running:
                record.move(LeaseState.RUNNING)
                record.expires_at = now + self.ttl_s
                record.seen_at = now
            elif record.seen_at <= now - self.grace_s:
                ended.append(record.lease_id)
        return self._end(ended, LeaseState.RECONCILED)

    def expire(self) -> list[LeaseRecord]:
        """Ends the leases past their TTL (EXPIRED)."""
        now = self._clock()
        return self._end(
            [r.lease_id for r in self._leases.values() if r.expires_at <= now], LeaseState.EXPIRED
        )

    def of_worker(self, worker_id: str) -> list[LeaseRecord]:
        """Ends every lease of a worker that is gone (WORKER_DOWN)."""
        return self._end(
            [r.lease_id for r in self._leases.values() if r.worker_id == worker_id], LeaseState.WORKER_DOWN
        )

    def _end(self, lease_ids: Iterable[str], how: LeaseState) -> list[LeaseRecord]:
        ended = []
        for lease_id in lease_ids:
            for one in (lease_id, self._companions.pop(lease_id, None)):
                record = self._leases.pop(one, None) if one is not None else None
                if record is not None:
                    record.move(how)
                    ended.append(record)
        return ended
