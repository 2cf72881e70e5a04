"""P/D routing over real gRPC with fake workers: a long uncached text prompt gets a prefill
worker of the decoder's KV layout (least loaded) named in the route; short, cached, image
or prompt-logprobs requests and incompatible prefill workers do not; once the workers
report prefill rates, a hand-off is made with its estimate in the route unless it is
expected to be much slower than a local prefill, and a prefill worker whose heartbeats
stopped gets none; the prefill lease ends with the decode lease on every path."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

from meshserve.v1 import common_pb2, kv_transfer_pb2, scheduler_pb2
from tests.scheduler_svc.conftest import RunningScheduler
from tests.scheduler_svc.route_client import release_counted

pytestmark = pytest.mark.timeout(60)

LAYOUT = kv_transfer_pb2.KvLayout(
    model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4
)
OTHER = kv_transfer_pb2.KvLayout(
    model="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4
)
LONG = list(range(10, 30))  # 20 tokens: 4 full blocks of 4 the decoder can cache
# Every test but the last turns pd_prefill_decodes off: a prefill worker then only ever
# prefills hand-offs, the paths they test.


async def pd_mesh(start_scheduler: Any, start_worker: Any, **prefill_kwargs: Any) -> RunningScheduler:
    sched = await start_scheduler(
        pd_prefill_decodes=False, pd_min_prompt_tokens=12, lease_ttl_s=30, lease_grace_s=30
    )
    await start_worker("d1", sched, kv_layout=LAYOUT)
    await start_worker(
        "p1", sched, role="prefill", kv_layout=prefill_kwargs.pop("layout", LAYOUT), **prefill_kwargs
    )
    return sched


async def test_long_prompt_gets_a_prefill_worker_and_both_leases_end_together(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await pd_mesh(start_scheduler, start_worker)
    await start_worker("p2", sched, role="prefill", kv_layout=LAYOUT)
    route = await sched.route(LONG)
    assert route.worker_id == "d1", "a prefill worker is never the decoder"
    assert route.HasField("kv_source")
    source = route.kv_source
    assert source.worker_id in ("p1", "p2") and source.transfer_id and source.lease_id
    assert sched.inflight(source.worker_id) == 1
    # The next one goes to the other, less loaded, prefill worker.
    second = await sched.route(list(range(40, 60)))
    assert second.kv_source.worker_id not in ("", source.worker_id)
    assert sched.lease_ids() == {route.lease_id, source.lease_id, second.lease_id, second.kv_source.lease_id}
    assert await sched.release(route.lease_id) == 1
    assert sched.inflight(source.worker_id) == 0, "the prefill lease ended with the decode lease"
    assert sched.lease_ids() == {second.lease_id, second.kv_source.lease_id}
    assert await sched.release(second.lease_id) == 1
    assert sched.lease_ids() == set()


async def test_a_prefill_worker_the_request_failed_on_is_no_kv_source(
    start_scheduler: Any, start_worker: Any
) -> None:
    """A request routed again after failing on a prefill worker (the gateway excludes it)
    takes no hand-off from it: a hung one, still within its heartbeats, would hold the
    retry's prefill until the hand-off's deadline. Another prefill worker still serves."""
    sched = await pd_mesh(start_scheduler, start_worker)
    route = await sched.route(LONG, exclude=["p1"])
    assert route.worker_id == "d1" and not route.HasField("kv_source")
    await start_worker("p2", sched, role="prefill", kv_layout=LAYOUT)
    other = await sched.route(list(range(40, 60)), exclude=["p1"])
    assert other.kv_source.worker_id == "p2"
    assert await sched.release(route.lease_id, other.lease_id) == 2


async def test_short_cached_image_and_logprob_requests_stay_on_the_decoder(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await pd_mesh(start_scheduler, start_worker)
    short = await sched.route(list(range(10, 20)))  # 10 tokens < 12
    assert not short.HasField("kv_source")
    first = await sched.route(LONG)
    assert first.HasField("kv_source")
    # 16 of the 20 tokens are now (speculatively) cached on d1: 4 uncached < 12.
    again = await sched.route(LONG)
    assert again.predicted_cached_tokens == 16 and not again.HasField("kv_source")
    sampling = common_pb2.SamplingParams(max_tokens=4, prompt_logprobs=1)
    logprobs = await sched.route(list(range(100, 130)), sampling=sampling)
    assert not logprobs.HasField("kv_source")
    for lease in (short, first, again, logprobs):
        await sched.release(lease.lease_id)
    assert sched.lease_ids() == set() and sched.inflight("p1") == 0


async def test_incompatible_or_missing_prefill_worker_means_no_hand_off(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await pd_mesh(start_scheduler, start_worker, layout=OTHER)
    route = await sched.route(LONG)
    assert not route.HasField("kv_source"), "a bf16 prefill worker never serves a float32 decoder"
    await sched.release(route.lease_id)
    off = await start_scheduler(lease_ttl_s=30, pd_prefill_decodes=False, pd_min_prompt_tokens=0)  # P/D off
    await start_worker("d2", off, kv_layout=LAYOUT)
    await start_worker("p3", off, role="prefill", kv_layout=LAYOUT)
    plain = await off.route(LONG)
    assert plain.worker_id == "d2" and not plain.HasField("kv_source")


async def test_prefill_worker_down_ends_only_its_lease(start_scheduler: Any, start_worker: Any) -> None:
    sched = await start_scheduler(
        pd_prefill_decodes=False, pd_min_prompt_tokens=12, lease_ttl_s=30, lease_grace_s=30
    )
    await start_worker("d1", sched, kv_layout=LAYOUT)
    prefill = await start_worker("p1", sched, role="prefill", kv_layout=LAYOUT)
    route = await sched.route(LONG)
    assert route.kv_source.worker_id == "p1"
    await prefill.kill()
    for _ in range(100):
        if route.kv_source.lease_id not in sched.lease_ids():
            break
        await asyncio.sleep(0.05)
    assert sched.lease_ids() == {route.lease_id}, "the decode lease lives on (the decoder falls back)"
    later = await sched.route(list(range(40, 60)))
    assert not later.HasField("kv_source")
    assert await sched.release(route.lease_id, later.lease_id) == 2


async def test_release_with_outcome_ends_both_leases(start_scheduler: Any, start_worker: Any) -> None:
    """The gateway's usual release carries the request's outcome (actual cached tokens):
    its decode lease and the linked prefill lease end, the stream stays up."""
    sched = await pd_mesh(start_scheduler, start_worker)
    route = await sched.route(LONG)
    assert route.HasField("kv_source")
    outcome = scheduler_pb2.LeaseOutcome(lease_id=route.lease_id, cached_tokens=16, prompt_tokens=len(LONG))
    assert await release_counted(sched.routes, sched.releases, outcomes=[outcome]) == 1
    assert sched.lease_ids() == set() and sched.inflight("p1") == 0
    again = await sched.route(list(range(40, 60)))  # the route stream still works
    assert again.HasField("kv_source")
    await sched.release(again.lease_id)


def _decisions(decision: str) -> float:
    return REGISTRY.get_sample_value("meshserve_scheduler_pd_decisions_total", {"decision": decision}) or 0.0


async def _report(*workers_and_loads: tuple[Any, dict[str, float]]) -> None:
    for worker, load in workers_and_loads:
        worker.reported = load
    for worker, _ in workers_and_loads:
        await worker.wait_beats(2)


async def _measured_pd_mesh(
    start_scheduler: Any, start_worker: Any, strict: bool = True
) -> tuple[RunningScheduler, Any, Any]:
    """A decoder and a prefill worker heartbeating every 100 ms (their reports set by the
    test); `strict`: the prefill worker takes hand-offs only."""
    sched = await start_scheduler(
        pd_prefill_decodes=not strict,
        pd_min_prompt_tokens=12,
        lease_ttl_s=30,
        lease_grace_s=30,
        heartbeat_interval_ms=100,
    )
    decoder = await start_worker("d1", sched, kv_layout=LAYOUT)
    prefill = await start_worker("p1", sched, role="prefill", kv_layout=LAYOUT)
    return sched, decoder, prefill


async def test_hand_off_unless_expected_much_slower_than_a_local_prefill(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched, decoder, prefill = await _measured_pd_mesh(start_scheduler, start_worker)
    rate = {"prefill_tokens_per_s": 1000.0}
    await _report((decoder, rate | {"kv_import_tokens_per_s": 4000.0}), (prefill, rate))
    idle = await sched.route(LONG)
    assert idle.kv_source.worker_id == "p1", "a tie (the pull aside) goes to the prefill worker"
    assert idle.kv_source.expected_ms == 25, "20 tokens at 1,000/s, pulled at 4,000/s"
    # The prefill worker has 9,000 prompt tokens queued, the decoder 5,000: 9 s against
    # 5 s, more than half the prompt's own prefill (10 ms) later.
    local = _decisions("local_faster")
    await _report(
        (decoder, rate | {"queued_prompt_tokens": 5000}), (prefill, rate | {"queued_prompt_tokens": 9000})
    )
    behind = await sched.route(list(range(40, 60)))
    assert not behind.HasField("kv_source")
    assert _decisions("local_faster") == local + 1
    # 5,010 queued there (the decoder has 5,000 and the 20 it took): within half this
    # prompt's own 20 ms prefill, handed off.
    await _report(
        (prefill, rate | {"queued_prompt_tokens": 5010}),
    )
    close = await sched.route(list(range(70, 90)))
    assert close.kv_source.worker_id == "p1"
    # Its heartbeats stop (hung): no hand-off within three heartbeat intervals.
    await _report(
        (prefill, rate),
    )
    prefill.heartbeating = False
    await asyncio.sleep(0.4)
    silent = await sched.route(list(range(100, 120)))
    assert not silent.HasField("kv_source")
    for route in (idle, behind, close, silent):
        await sched.release(route.lease_id)
    assert sched.lease_ids() == set()


async def test_threshold_decision_hands_off_every_long_prompt(
    start_scheduler: Any, start_worker: Any
) -> None:
    sched = await start_scheduler(
        pd_prefill_decodes=False, pd_min_prompt_tokens=12, pd_decision="threshold", lease_ttl_s=30
    )
    decoder = await start_worker("d1", sched, kv_layout=LAYOUT)
    prefill = await start_worker("p1", sched, role="prefill", kv_layout=LAYOUT)
    rate = {"prefill_tokens_per_s": 1000.0}
    await _report((decoder, rate), (prefill, rate | {"queued_prompt_tokens": 480}))
    route = await sched.route(LONG)
    assert route.kv_source.worker_id == "p1"
    assert route.kv_source.expected_ms == 500, "its estimate still travels with it"
    await sched.release(route.lease_id)


async def test_prompts_routed_since_the_last_heartbeat_count_as_queued(
    start_scheduler: Any, start_worker: Any
) -> None:
    """Between two reports the scheduler adds what it sent to each side's queue: a burst
    of long prompts spreads over both instead of all going to the prefill worker (after
    three hand-offs its queue is more than 50 % longer than the decoder's)."""
    sched = await start_scheduler(
        pd_prefill_decodes=False,
        pd_min_prompt_tokens=12,
        lease_ttl_s=30,
        lease_grace_s=30,
        heartbeat_interval_ms=2000,
        worker_timeout_s=30,
        worker_forget_s=60,
    )
    decoder = await start_worker("d1", sched, kv_layout=LAYOUT)
    prefill = await start_worker("p1", sched, role="prefill", kv_layout=LAYOUT)
    rate = {"prefill_tokens_per_s": 1000.0}
    await _report((decoder, rate | {"queued_prompt_tokens": 30}), (prefill, rate))
    decoder.heartbeating = prefill.heartbeating = False  # the burst comes before the next report
    routes = [await sched.route(list(range(200 * i, 200 * i + 20))) for i in range(6)]
    sources = [r.kv_source.worker_id for r in routes]
    assert "p1" in sources and "" in sources, sources
    for route in routes:
        await sched.release(route.lease_id)


async def test_a_route_counts_in_its_workers_queue_until_the_worker_lists_it(
    start_scheduler: Any, start_worker: Any
) -> None:
    """Heartbeats come between the routes, but the prefill worker lists none of the
    hand-offs yet (still on their way to it): each still counts in its queue, so the
    fourth prompt stays on the decoder (80 ms there against 60 ms here, more than half its
    own 20 ms prefill later). Once it lists them its own report counts them (here: all
    done), and prompts go to it again."""
    sched, decoder, prefill = await _measured_pd_mesh(start_scheduler, start_worker)
    rate = {"prefill_tokens_per_s": 1000.0}
    await _report((decoder, rate | {"queued_prompt_tokens": 40}), (prefill, rate))
    routes = []
    for i in range(4):
        routes.append(await sched.route(list(range(200 * i, 200 * i + 20))))
        await prefill.wait_beats(2)
    assert [r.kv_source.worker_id for r in routes] == ["p1", "p1", "p1", ""]
    prefill.lease_ids = {r.kv_source.lease_id for r in routes[:3]}
    await prefill.wait_beats(2)
    again = await sched.route(list(range(1000, 1020)))
    assert again.kv_source.worker_id == "p1"
    for route in (*routes, again):
        await sched.release(route.lease_id)
    assert sched.lease_ids() == set()


async def test_a_decoder_pulls_the_prefix_another_decoder_holds(
    start_scheduler: Any, start_worker: Any
) -> None:
    """Decoders sharing KV (kv_share.py): the first decoder is full, so the prompt goes to
    the second, which is told to pull the 16 tokens the first holds (it publishes 17: one
    computed past its blocks); the share's lease ends with the decode lease. Off, or
    across KV layouts: no source."""
    sched = await start_scheduler(
        kv_share_min_tokens=8, max_inflight_per_worker=1, lease_ttl_s=30, lease_grace_s=30
    )
    await start_worker("d1", sched, kv_layout=LAYOUT)
    await start_worker("d2", sched, kv_layout=LAYOUT)
    first = await sched.route(LONG)
    second = await sched.route(LONG)
    assert {first.worker_id, second.worker_id} == {"d1", "d2"} and not first.HasField("kv_source")
    source = second.kv_source
    assert source.worker_id == first.worker_id and source.num_prompt_tokens == 17 and source.lease_id
    assert await sched.release(second.lease_id) == 1
    assert sched.lease_ids() == {first.lease_id}, "the share's lease ended with the decode lease"
    await sched.release(first.lease_id)
    for options, layout in (({"kv_share_min_tokens": 0}, LAYOUT), ({"kv_share_min_tokens": 8}, OTHER)):
        other = await start_scheduler(max_inflight_per_worker=1, lease_ttl_s=30, **options)
        await start_worker("e1", other, kv_layout=LAYOUT)
        await start_worker("e2", other, kv_layout=layout)
        held = await other.route(LONG)
        assert not (await other.route(LONG)).HasField("kv_source")
        await other.release(held.lease_id)


async def test_a_prefill_worker_takes_whole_the_short_requests_the_policy_ranks_it_best_for(
    start_scheduler: Any, start_worker: Any
) -> None:
    """pd_prefill_decodes (the default): with the decoder busier, a short prompt runs
    whole on the idle prefill worker (no hand-off, counted `on_prefill_worker`), while a
    prompt long enough for a hand-off still goes to the decoder and is handed off to the
    prefill worker; with the prefill worker the busier, short prompts go to the decoder."""
    sched, decoder, prefill = await _measured_pd_mesh(start_scheduler, start_worker, strict=False)
    await _report((decoder, {"num_waiting": 6}), (prefill, {}))
    whole = _decisions("on_prefill_worker")
    short = await sched.route(list(range(40, 48)))
    assert short.worker_id == "p1" and not short.HasField("kv_source")
    assert _decisions("on_prefill_worker") == whole + 1
    long = await sched.route(LONG)
    assert long.worker_id == "d1" and long.kv_source.worker_id == "p1"
    await _report((decoder, {}), (prefill, {"num_waiting": 6}))
    local = await sched.route(list(range(70, 78)))
    assert local.worker_id == "d1"
    for route in (short, long, local):
        await sched.release(route.lease_id)
    assert sched.lease_ids() == set()


async def test_short_prompts_keep_off_a_prefill_worker_with_a_long_prompt_queued(
    start_scheduler: Any, start_worker: Any
) -> None:
    """pd_prefill_decodes: a short prompt the policy ranks the prefill worker best for
    (the decoder busier) goes to the decoder while the prefill worker reports a quarter of
    a hand-off's length queued (there, its stream would wait for a long prefill's steps),
    and to the prefill worker again once what it has queued is less."""
    sched, decoder, prefill = await _measured_pd_mesh(start_scheduler, start_worker, strict=False)
    routes = []
    for queued in (3, 2):  # pd_min_prompt_tokens 12: a long prompt queued from 3 tokens
        await _report((decoder, {"num_waiting": 6}), (prefill, {"queued_prompt_tokens": queued}))
        routes.append(await sched.route(list(range(40 + queued, 48 + queued))))
        await sched.release(routes[-1].lease_id)
    assert [r.worker_id for r in routes] == ["d1", "p1"]
    assert sched.lease_ids() == set()


async def test_a_long_prompt_goes_whole_where_it_is_computed_soonest(
    start_scheduler: Any, start_worker: Any
) -> None:
    """pd_prefill_decodes, rates measured: a long prompt runs whole on the prefill worker
    when it computes it no later than the decoder could (a hand-off from it would only add
    a pull), else on the decoder, prefilled there: the hand-off margin does not apply while
    prefill workers carry streams too (5,022 queued there against the decoder's 5,020, the
    20 of the previous prompt included, would be handed off within half this prompt's own
    prefill with prefill workers taking hand-offs alone, and is prefilled here now)."""
    sched, decoder, prefill = await _measured_pd_mesh(start_scheduler, start_worker, strict=False)
    rate = {"prefill_tokens_per_s": 1000.0}
    await _report((decoder, rate | {"kv_import_tokens_per_s": 4000.0}), (prefill, rate))
    whole, local = _decisions("on_prefill_worker"), _decisions("local_faster")
    tie = await sched.route(LONG)
    assert tie.worker_id == "p1" and not tie.HasField("kv_source")
    assert _decisions("on_prefill_worker") == whole + 1
    await sched.release(tie.lease_id)
    routes = []
    for queued in (9000, 5022):
        await _report(
            (decoder, rate | {"queued_prompt_tokens": 5000}),
            (prefill, rate | {"queued_prompt_tokens": queued}),
        )
        routes.append(await sched.route(list(range(queued, queued + 20))))
    assert [(r.worker_id, r.HasField("kv_source")) for r in routes] == [("d1", False), ("d1", False)]
    assert _decisions("local_faster") == local + 2
    for route in routes:
        await sched.release(route.lease_id)
    assert sched.lease_ids() == set()
