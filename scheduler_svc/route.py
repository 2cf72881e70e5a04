"""Routes (admission + routing → a lease) and Embed forwarding.

The scheduler decides and stays out of the token stream: `route` admits the request
(bounded priority queue, per-tenant fairness, overload → RESOURCE_EXHAUSTED), encodes
the images the encoder cache lacks, lets the routing policy pick a decoder worker and
returns a lease on it. The caller runs the request on that worker itself and releases
the lease at the end (or the worker's heartbeats end it, see `leases`). Failover is the
caller's: it routes again with the failed worker excluded.

Embedding calls are short and unary, so they still go through the scheduler.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from meshserve.v1 import common_pb2, kv_transfer_pb2, scheduler_pb2
from scheduler_svc import metrics
from scheduler_svc.kv_share import ShareDecider
from scheduler_svc.leases import LeaseRecord
from scheduler_svc.multimodal import EncodeCoordinator
from scheduler_svc.pd import Handoff, PdDecider
from scheduler_svc.policies import Decision, RoutingRequest
from scheduler_svc.registry import Lease, WorkerState
from scheduler_svc.scheduler import Scheduler
from services.errors import InvalidArgument, Unavailable
from services.kv_contract import request_extra_keys
from services.rpc import error_from_rpc, peer_lost


@dataclass(frozen=True)
class RouteResult:
    """A lease on the chosen worker and the request's images as that worker takes them."""

    request_id: str
    lease: LeaseRecord
    decision: Decision
    mm_items: list[common_pb2.MultiModalItem]
    predicted_cached_tokens: int
    # P/D: the prefill worker's lease (ends with `lease`), the transfer id and the
    # hand-off's expected seconds, or None.
    prefill: LeaseRecord | None = None
    transfer_id: str = ""
    expected_s: float = 0.0
    # Of the prompt, the tokens the source publishes (a decoder sharing its prefix,
    # kv_share.py); 0: the whole prompt (a prefill worker's hand-off).
    source_tokens: int = 0


def route_response(result: RouteResult, lease_ttl_ms: int) -> scheduler_pb2.RouteResponse:
    """The proto answer of a route on a RouteStream."""
    spec = result.decision.worker.spec
    response = scheduler_pb2.RouteResponse(
        request_id=result.request_id,
        lease_id=result.lease.lease_id,
        worker_id=spec.worker_id,
        worker_address=spec.address,
        mm_items=result.mm_items,
        predicted_cached_tokens=result.predicted_cached_tokens,
        lease_ttl_ms=lease_ttl_ms,
        reason=result.decision.reason,
    )
    if result.prefill is not None:
        prefill = result.prefill.lease.worker.spec
        response.kv_source.CopyFrom(
            kv_transfer_pb2.KvSource(
                worker_id=prefill.worker_id,
                address=prefill.address,
                transfer_id=result.transfer_id,
                lease_id=result.prefill.lease_id,
                expected_ms=round(result.expected_s * 1000),
                num_prompt_tokens=result.source_tokens,
            )
        )
    return response


def routing_request(request: common_pb2.GenerateRequest, adapter: bool = False) -> RoutingRequest:
    """The policy's view of a request; its block hashes use the workers' extra keys.
    ``adapter``: its `model` names a LoRA adapter (the workers key its blocks by it)."""
    if not request.model:
        raise InvalidArgument("model is required", param="model")
    if not request.prompt_token_ids:
        raise InvalidArgument("prompt_token_ids must not be empty", param="prompt")
    if request.HasField("queue_timeout_s") and not 0 <= request.queue_timeout_s < math.inf:
        raise InvalidArgument("queue_timeout_s must be >= 0 seconds", param="queue_timeout_s")
    return RoutingRequest(
        request_id=request.request_id,
        model=request.model,
        token_ids=request.prompt_token_ids,
        extra_keys=request_extra_keys(
            request.cache_salt, request.mm_items, lora_name=request.model if adapter else ""
        ),
        priority=request.priority,
        tenant=request.tenant,
        adapter=request.model if adapter else "",
        queue_timeout_s=request.queue_timeout_s if request.HasField("queue_timeout_s") else None,
    )


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens the worker should find cached: the matched full blocks, capped like the
    worker's block manager (at least the prompt's last token is always computed)."""
    if prompt_tokens <= 0 or block_size <= 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


def record_cached_tokens(policy: str, predicted: int, actual: int) -> None:
    """Predicted vs actual cached tokens of one request, as Prometheus series."""
    metrics.CACHED_TOKENS.labels(policy=policy, kind="predicted").observe(predicted)
    metrics.CACHED_TOKENS.labels(policy=policy, kind="actual").observe(actual)
    metrics.CACHED_TOKENS_ERROR.labels(policy=policy).observe(actual - predicted)
    outcome = "exact" if actual == predicted else ("over" if predicted > actual else "under")
    metrics.CACHE_PREDICTIONS.labels(policy=policy, outcome=outcome).inc()


class Router:
    """Routes and Embed against the workers chosen by the scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.max_retries = scheduler.config.max_retries
        self.mm = EncodeCoordinator(scheduler)
        config = scheduler.config
        # A prefill worker three heartbeats late gets no more hand-offs (pd.py).
        self.pd = PdDecider(
            config.pd_min_prompt_tokens,
            config.pd_handoff_margin,
            3 * config.heartbeat_interval_s,
            estimate=config.pd_decision == "estimate",
        )
        self.share = ShareDecider(config.kv_share_min_tokens, 3 * config.heartbeat_interval_s)

    async def route(
        self, request: common_pb2.GenerateRequest, exclude: frozenset[str], force_encode: bool = False
    ) -> RouteResult:
        """Admits and routes `request` (waiting in the queue while workers are full)."""
        received_at = time.perf_counter()
        routing = self._admit(request, exclude)
        mm_items = list(request.mm_items)
        if mm_items:  # images: encode what the encoder cache lacks (E/PD disaggregation)
            mm_items = list((await self.mm.prepare(request, force=force_encode)).mm_items)
        lease, decision = await self.scheduler.dispatcher.acquire(routing, exclude, retry=bool(exclude))
        return self._issue(request, routing, lease, decision, mm_items, received_at, exclude)

    def route_now(self, request: common_pb2.GenerateRequest, exclude: frozenset[str]) -> RouteResult | None:
        """The route of a request that needs no waiting (no images to encode, a worker
        free now, nobody queued before it), without a task or an await; None when it
        must go through `route`. Errors as `route`."""
        if request.mm_items:
            return None
        received_at = time.perf_counter()
        routing = self._admit(request, exclude)
        placed = self.scheduler.dispatcher.acquire_now(routing, exclude)
        if placed is None:
            return None
        return self._issue(request, routing, placed[0], placed[1], [], received_at, exclude)

    def _admit(self, request: common_pb2.GenerateRequest, exclude: frozenset[str]) -> RoutingRequest:
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        registry = self.scheduler.registry
        routing = routing_request(request, registry.is_adapter(request.model))
        prompt_tokens = len(request.prompt_token_ids)
        if self.pd.may_hand_off(prompt_tokens) and self._kv_may_move(request, list(request.mm_items)):
            whole = self.pd.whole_on_prefill(
                registry, routing.model, prompt_tokens, lambda w: self._cached_tokens(routing, w), exclude
            )
            routing.only_role = "prefill" if whole else "decoder"
        elif self.pd.short_on_decoders(registry, routing.model, exclude):
            routing.only_role = "decoder"
        if exclude and not request.resumed:  # a migration or a move is not a failover
            metrics.FAILOVERS.labels(outcome="rerouted").inc()
        return routing

    def _issue(
        self,
        request: common_pb2.GenerateRequest,
        routing: RoutingRequest,
        lease: Lease,
        decision: Decision,
        mm_items: list[common_pb2.MultiModalItem],
        received_at: float,
        exclude: frozenset[str],
    ) -> RouteResult:
        block_size = decision.worker.spec.block_size or self.scheduler.config.block_size
        predicted = predicted_cached_tokens(
            decision.matched_blocks, len(request.prompt_token_ids), block_size
        )
        active = self.scheduler.leases.issue(lease, request.request_id, predicted)
        source = None
        if self._kv_may_move(request, mm_items):
            # A worker the request failed on is no KV source either: a hung prefill worker
            # still heartbeating would otherwise hold the retry's hand-off to its deadline.
            source = self._pair_prefill(request, active, predicted, exclude) or self._pair_holder(
                request, routing, active, decision, exclude
            )
        metrics.LEASES.set(len(self.scheduler.leases))
        metrics.OVERHEAD.observe(time.perf_counter() - received_at)
        if source is None:
            return RouteResult(request.request_id, active, decision, mm_items, predicted)
        prefill, expected_s, tokens = source
        return RouteResult(
            request.request_id,
            active,
            decision,
            mm_items,
            predicted,
            prefill,
            uuid.uuid4().hex,
            expected_s,
            tokens,
        )

    def _pair_prefill(
        self,
        request: common_pb2.GenerateRequest,
        decode: LeaseRecord,
        predicted: int,
        exclude: frozenset[str],
    ) -> tuple[LeaseRecord, float, int] | None:
        """P/D (`pd.py`): a lease on a prefill worker for this route, linked to the
        decode lease so that it ends with it, the hand-off's expected seconds, and 0 (the
        whole prompt); None when the decoder prefills itself."""
        uncached = len(request.prompt_token_ids) - predicted
        handoff: Handoff | None = self.pd.decide(
            self.scheduler.registry, decode.lease.worker, uncached, exclude
        )
        if handoff is None:
            decode.route_prompt_tokens(uncached)
            return None
        source = self._source_lease(request, decode, handoff.worker)
        source.route_prompt_tokens(uncached)
        return source, handoff.expected_s, 0

    def _pair_holder(
        self,
        request: common_pb2.GenerateRequest,
        routing: RoutingRequest,
        decode: LeaseRecord,
        decision: Decision,
        exclude: frozenset[str],
    ) -> tuple[LeaseRecord, float, int] | None:
        """Decoders sharing KV (`kv_share.py`): a lease on the decoder holding more of the
        prompt's prefix, the expected seconds, and the prompt tokens it publishes."""
        decoder = decode.lease.worker
        share = self.share.decide(
            self.scheduler.registry,
            self.scheduler.index,
            decoder,
            routing.hashes(decoder.spec.block_size or self.scheduler.config.block_size),
            decision.matched_blocks,
            len(request.prompt_token_ids),
            exclude,
        )
        if share is None:
            return None
        return self._source_lease(request, decode, share.worker), share.expected_s, share.num_tokens

    def _cached_tokens(self, routing: RoutingRequest, worker: WorkerState) -> int:
        """The prompt tokens ``worker`` should find in its cache (the prefix index)."""
        block_size = worker.spec.block_size or self.scheduler.config.block_size
        matched = self.scheduler.index.match(routing.hashes(block_size), [worker.worker_id])
        return predicted_cached_tokens(matched[worker.worker_id], len(routing.token_ids), block_size)

    def _kv_may_move(
        self, request: common_pb2.GenerateRequest, mm_items: list[common_pb2.MultiModalItem]
    ) -> bool:
        """Whether the request's KV may come from another worker (not with images, a LoRA
        adapter or prompt logprobs: pd.py)."""
        adapter = self.scheduler.registry.is_adapter(request.model)
        return not (mm_items or adapter or request.sampling.HasField("prompt_logprobs"))

    def _source_lease(
        self, request: common_pb2.GenerateRequest, decode: LeaseRecord, worker: WorkerState
    ) -> LeaseRecord:
        """A lease on the worker the decoder pulls KV from, ending with the decode lease."""
        leases = self.scheduler.leases
        source = leases.issue(self.scheduler.registry.acquire(worker), request.request_id)
        leases.link(decode.lease_id, source.lease_id)
        return source

    def release(self, lease_ids: list[str], outcomes: Sequence[scheduler_pb2.LeaseOutcome] = ()) -> int:
        """Ends leases (their requests finished); returns how many this replica knew.
        `outcomes` end their leases too, and their actual cached tokens are recorded
        next to the prediction made when routing (index drift shows there)."""
        leases = self.scheduler.leases
        ended = leases.release(lease_ids)
        reported = leases.release(o.lease_id for o in outcomes)
        actual = {o.lease_id: o.cached_tokens for o in outcomes}
        policy = self.scheduler.policy.name
        for lease in reported:
            if lease.lease_id in actual:  # not a P/D prefill lease that ended with its decode lease
                record_cached_tokens(policy, lease.predicted_cached_tokens, actual[lease.lease_id])
        ended.extend(reported)
        self.scheduler.end_leases(ended)
        # A P/D prefill lease that ended with its decode lease is not one the caller named.
        named = set(lease_ids) | actual.keys()
        return sum(1 for lease in ended if lease.lease_id in named)

    async def embed(self, request: common_pb2.EmbedRequest) -> common_pb2.EmbedResponse:
        """Routes an embedding request to an embedding worker for its model."""
        if not request.model:
            raise InvalidArgument("model is required", param="model")
        routing = RoutingRequest(request.request_id or uuid.uuid4().hex, request.model, role="embedding")
        exclude: set[str] = set()
        dispatcher = self.scheduler.dispatcher
        for attempt in range(self.max_retries + 1):
            lease, _ = await dispatcher.acquire(routing, frozenset(exclude), retry=attempt > 0)
            spec = lease.worker.spec
            try:
                reply: common_pb2.EmbedResponse = await self.scheduler.channels.stub(
                    spec.worker_id, spec.address
                ).Embed(request)
                return reply
            except grpc.aio.AioRpcError as exc:
                if not peer_lost(exc) or attempt == self.max_retries:
                    raise error_from_rpc(exc) from exc
                self.scheduler.worker_failed(spec.worker_id)
                exclude.add(spec.worker_id)
            finally:
                dispatcher.release(lease)
        raise Unavailable(f"no embedding worker could serve model '{request.model}'")
