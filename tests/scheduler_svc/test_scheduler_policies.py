"""Routing policies: round-robin order, least-load choice, prefix affinity, load cap."""

from __future__ import annotations

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.policies import (
    WEIGHT_OPTIONS,
    LeastLoadPolicy,
    PrefixAwarePolicy,
    PrefixWeights,
    RoundRobinPolicy,
    RoutingRequest,
    make_policy,
    tier_load_cost,
)
from scheduler_svc.prefix_index import PrefixIndex
from scheduler_svc.registry import LoadSnapshot, WorkerSpec, WorkerState
from scheduler_svc.scheduler import Scheduler
from services.kv_hash import block_hashes

BS = 4


def worker(worker_id: str, running: int = 0, kv: float = 0.0, capacity: int = 10) -> WorkerState:
    state = WorkerState(WorkerSpec(worker_id, "addr", "decoder", "m", 512, BS, 100, capacity))
    state.capacity = capacity
    state.load = LoadSnapshot(num_running=running, kv_usage=kv)
    state.external_load = running
    return state


def request(tokens: list[int], salt: tuple[str, ...] = ()) -> RoutingRequest:
    return RoutingRequest("r", "m", tokens, salt)


def test_round_robin_cycles_in_id_order_and_survives_membership_changes() -> None:
    policy = RoundRobinPolicy()
    ws = [worker("b"), worker("a"), worker("c")]
    picks = [policy.choose(request([]), ws).worker.worker_id for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    # "b" leaves: the rotation continues after "a" with the next id.
    assert policy.choose(request([]), [worker("a"), worker("c")]).worker.worker_id == "c"


def test_least_load_prefers_fewest_requests_then_kv_usage() -> None:
    policy = LeastLoadPolicy()
    ws = [worker("a", running=3), worker("b", running=1, kv=0.9), worker("c", running=1, kv=0.2)]
    assert policy.choose(request([]), ws).worker.worker_id == "c"
    # Our own in-flight requests count even before a heartbeat reports them.
    ws[2].inflight = 5
    assert policy.choose(request([]), ws).worker.worker_id == "b"
    # Capacity matters: 4 of 40 is less loaded than 1 of 2.
    big, small = worker("big", running=4, capacity=40), worker("small", running=1, capacity=2)
    assert policy.choose(request([]), [small, big]).worker.worker_id == "big"


def test_least_load_ties_rotate() -> None:
    policy = LeastLoadPolicy()
    ws = [worker("a"), worker("b")]
    picks = {policy.choose(request([]), ws).worker.worker_id for _ in range(2)}
    assert picks == {"a", "b"}


def test_prefix_scorer_prefers_worker_holding_the_prefix() -> None:
    index = PrefixIndex()
    tokens = list(range(32))
    hashes = block_hashes(tokens, BS)
    index.reset_worker("b", hashes[:6], "e", 1)
    index.reset_worker("c", hashes[:2], "e", 1)
    policy = PrefixAwarePolicy(index)
    ws = [worker("a"), worker("b", running=1), worker("c")]
    decision = policy.choose(request(tokens), ws)
    assert decision.worker.worker_id == "b"
    assert (decision.reason, decision.matched_blocks, decision.total_blocks) == ("prefix", 6, 8)


def test_prefix_scorer_respects_extra_keys() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(16))
    index.reset_worker("b", block_hashes(tokens, BS, ("salt:x",)), "e", 1)
    policy = PrefixAwarePolicy(index)
    ws = [worker("a"), worker("b")]
    assert policy.choose(request(tokens, ("salt:x",)), ws).worker.worker_id == "b"
    # Same tokens, other salt: no hit, so the least loaded (tie → any) with no prefix reason.
    assert policy.choose(request(tokens, ("salt:y",)), ws).matched_blocks == 0


def test_short_shared_prefix_loses_to_a_much_less_loaded_worker() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(40))
    index.reset_worker("hot", block_hashes(tokens, BS)[:2], "e", 1)  # 2 of 10 blocks
    policy = PrefixAwarePolicy(index)
    ws = [worker("hot", running=5), worker("idle")]
    assert policy.choose(request(tokens), ws).worker.worker_id == "idle"


def test_a_prefix_in_a_workers_tier_is_priced_at_what_loading_it_costs() -> None:
    """Two idle workers hold the whole prefix, one in its cache, one mostly in its KV
    tier: while the tier's loads are unmeasured both count alike; once the worker says
    loading costs 3/4 of computing (prefill 3,000 tok/s, tier 4,000), the cache wins, and
    the tier still beats a worker with a shorter prefix in its cache."""
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(40))
    hashes = block_hashes(tokens, BS)  # 10 blocks
    index.reset_worker("cache", hashes, "e", 1)
    index.reset_worker("tier", hashes, "e", 1, tiered=hashes[2:])
    policy = PrefixAwarePolicy(index)
    cache, tier = worker("cache"), worker("tier")
    scores = policy.scores(request(tokens), [cache, tier])
    assert scores["cache"] == scores["tier"]
    tier.load = LoadSnapshot(prefill_tokens_per_s=3000.0, kv_tier_load_tokens_per_s=4000.0)
    assert tier_load_cost(tier) == 0.75
    assert policy.choose(request(tokens), [tier, cache]).worker.worker_id == "cache"
    index.reset_worker("cache", hashes[:3], "e", 2)  # 3 blocks cached, against 2 + 8 x 1/4
    assert policy.choose(request(tokens), [tier, cache]).worker.worker_id == "tier"
    # A tier slower than computing counts for nothing, never less.
    tier.load = LoadSnapshot(prefill_tokens_per_s=9000.0, kv_tier_load_tokens_per_s=4000.0)
    assert tier_load_cost(tier) == 1.0
    assert policy.choose(request(tokens), [tier, cache]).worker.worker_id == "cache"


def test_load_cap_falls_back_to_least_load() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(40))
    index.reset_worker("hot", block_hashes(tokens, BS), "e", 1)
    policy = PrefixAwarePolicy(
        index, PrefixWeights(prefix=10.0, load_cap=0.8, load_imbalance=10.0, load_spread=10.0)
    )
    below = [worker("hot", running=7), worker("cold", running=0)]
    assert policy.choose(request(tokens), below).worker.worker_id == "hot"
    over = [worker("hot", running=8), worker("cold", running=0)]
    decision = policy.choose(request(tokens), over)
    assert (decision.worker.worker_id, decision.reason) == ("cold", "load_cap")
    # Every worker at the cap: moving the request gains nothing, it stays with its prefix.
    saturated = [worker("hot", running=9), worker("cold", running=9)]
    assert policy.choose(request(tokens), saturated).worker.worker_id == "hot"


def test_imbalance_cap_moves_affinity_to_the_least_loaded() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(40))
    index.reset_worker("hot", block_hashes(tokens, BS), "e", 1)
    policy = PrefixAwarePolicy(index, PrefixWeights(load_cap=1.0, load_imbalance=0.5, load_imbalance_min=2.0))
    # Mean with the request (3 + 0 + 1) / 2 = 2: hot would carry 4, 2 above -- within max(0.5 * 2, 2).
    assert (
        policy.choose(request(tokens), [worker("hot", running=3), worker("cold", running=0)]).reason
        == "prefix"
    )
    # Mean 2.5: hot would carry 5, 2.5 above -- over the slack, the request moves.
    decision = policy.choose(request(tokens), [worker("hot", running=4), worker("cold", running=0)])
    assert (decision.worker.worker_id, decision.reason) == ("cold", "load_cap")


def test_imbalance_cap_is_relative_to_the_mean_load() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(40))
    index.reset_worker("hot", block_hashes(tokens, BS), "e", 1)
    policy = PrefixAwarePolicy(index, PrefixWeights(load_cap=1.0, load_imbalance=0.5, load_imbalance_min=0.0))
    busy = [worker("hot", running=7, capacity=32), worker("cold", running=5, capacity=32)]
    # Mean 6.5, hot would carry 8: 1.5 above, within 0.5 * 6.5 -- the history's worker keeps it.
    assert policy.choose(request(tokens), busy).worker.worker_id == "hot"
    skewed = [worker("hot", running=12, capacity=32), worker("cold", running=4, capacity=32)]
    decision = policy.choose(request(tokens), skewed)
    assert (decision.worker.worker_id, decision.reason) == ("cold", "load_cap")


def test_load_cap_keeps_the_best_scoring_worker_within_the_cap() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(64))
    hashes = block_hashes(tokens, BS)
    index.reset_worker("hot", hashes, "e", 1)
    index.reset_worker("warm", hashes[:2], "e", 1)  # the shared system prompt only
    policy = PrefixAwarePolicy(index, PrefixWeights(load_cap=1.0, load_imbalance=0.5, load_imbalance_min=1.0))
    ws = [worker("hot", running=9, capacity=32), worker("warm", running=3, capacity=32),
          worker("cold", running=3, capacity=32)]  # fmt: skip
    decision = policy.choose(request(tokens), ws)
    # Not the least-loaded tie (cold): warm still holds part of the prompt.
    assert (decision.worker.worker_id, decision.reason, decision.matched_blocks) == ("warm", "load_cap", 2)


def test_routing_decisions_are_followed_by_the_next_request() -> None:
    index = PrefixIndex(speculative_ttl_s=5.0)
    policy = PrefixAwarePolicy(index)
    tokens = list(range(64))
    ws = [worker("a"), worker("b")]
    first = policy.choose(request(tokens), ws).worker.worker_id
    # Before any KV event, the same prompt follows the first one.
    second = policy.choose(request([*tokens, 99, 98, 97, 96]), ws)
    assert second.worker.worker_id == first and second.matched_blocks == 16


def test_make_policy() -> None:
    index = PrefixIndex()
    assert make_policy("round_robin", index).name == "round_robin"
    assert make_policy("least_load", index).name == "least_load"
    assert make_policy("prefix", index).name == "prefix"


def test_an_idle_worker_is_not_left_idle_beside_a_crowded_one() -> None:
    index = PrefixIndex(speculative_ttl_s=0)
    tokens = list(range(40))
    index.reset_worker("hot", block_hashes(tokens, BS), "e", 1)
    # Within the mean rule (mean 23/3, hot would carry 10: 2.3 above, slack 3.8) ...
    weights = PrefixWeights(load_cap=1.0, load_imbalance=0.5, load_imbalance_min=2.0)
    ws = [worker("hot", running=9, capacity=32), worker("busy", running=11, capacity=32),
          worker("idle", running=2, capacity=32)]  # fmt: skip
    # ... but 7 above the idle worker and 10 > 2 x 3: the request goes there.
    decision = PrefixAwarePolicy(index, weights).choose(request(tokens), ws)
    assert (decision.worker.worker_id, decision.reason) == ("idle", "load_cap")
    relaxed = PrefixWeights(load_cap=1.0, load_imbalance=0.5, load_imbalance_min=2.0, load_spread=10.0)
    assert PrefixAwarePolicy(index, relaxed).choose(request(tokens), ws).worker.worker_id == "hot"


def test_each_option_sets_its_own_weight_in_the_schedulers_policy() -> None:
    """Distinct option values land in the weights of the same name (a positional list once
    shifted every weight after a new field by one)."""
    values = {"prefix_weight": 3.0, "queue_weight": 5.0, "kv_weight": 7.0, "load_cap": 0.6}
    values |= {"load_imbalance": 0.3, "load_imbalance_min": 1.5, "load_spread": 2.5, "load_spread_min": 6.0}
    assert set(values) == set(WEIGHT_OPTIONS.values())
    config = SchedulerConfig(routing_policy="prefix", **values)
    policy = Scheduler(config).policy
    assert isinstance(policy, PrefixAwarePolicy)
    weights = policy._weights
    assert {name: getattr(weights, name) for name in WEIGHT_OPTIONS} == {
        name: values[option] for name, option in WEIGHT_OPTIONS.items()
    }
    assert weights.adapter == PrefixWeights().adapter
