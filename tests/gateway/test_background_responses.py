"""Background responses (gateway/background.py) with the official openai SDK on two
gateway replicas sharing a real redis-server: queued at once, streamed again from the
other replica after a sequence number, cancelled from the other replica (the request
aborted on its worker); refusals name their field; Redis down is a 503 naming the store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import openai
import pytest
import redis
from gateway_fakes import MODEL, SLOW_STEP_S, Harness, RunningGateway, wait_for
from prometheus_client import REGISTRY

from gateway import background
from gateway.response_store import ResponseStore
from services.redis_client import RedisServer
from tests.fake_worker import FakeWorker

pytestmark = pytest.mark.timeout(60)
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture
def gateways(harness: Harness, redis_server: RedisServer) -> Iterator[list[RunningGateway]]:
    config = harness.config(redis_url=redis_server.url, api_keys=("k1", "k2"))
    gws = [harness.start_gateway(config) for _ in range(2)]
    yield gws
    for g in gws:
        harness.stop_gateway(g)


def _client(gw: RunningGateway, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _wait_done(client: openai.OpenAI, response_id: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status in TERMINAL:
            return response
        time.sleep(0.05)
    raise AssertionError(f"{response_id} did not finish")


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_queued_at_once_then_completed_on_any_replica(gateways: list[RunningGateway]) -> None:
    one, two = (_client(g) for g in gateways)
    foreground = one.responses.create(model=MODEL, input="hi", max_output_tokens=40)
    queued = one.responses.create(model=MODEL, input="hi", max_output_tokens=40, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _wait_done(two, queued.id)
    assert done.status == foreground.status and done.output_text == foreground.output_text != ""
    with pytest.raises(openai.NotFoundError):  # another key's response is not found
        _client(gateways[1], "k2").responses.retrieve(queued.id)


def test_a_stream_resumes_on_the_other_replica_after_a_sequence_number(
    gateways: list[RunningGateway],
) -> None:
    one, two = (_client(g) for g in gateways)
    reference = one.responses.create(model=MODEL, input="SLOW", max_output_tokens=60)
    seen: list[Any] = []
    with one.responses.create(
        model=MODEL, input="SLOW", max_output_tokens=60, background=True, stream=True
    ) as stream:
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) >= 8:
                break  # the client's connection drops
    response_id = seen[0].response.id
    rest = list(two.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))  # each exactly once
    assert events[-1].type == f"response.{reference.status}" == "response.incomplete"  # cut at 60 tokens
    assert _text(events) == reference.output_text
    replay = list(two.responses.retrieve(response_id, stream=True))  # all of it, after the end too
    assert [e.sequence_number for e in replay] == list(range(len(events)))


def test_a_replica_stopping_mid_generation_hands_the_response_over(
    harness: Harness, redis_server: RedisServer
) -> None:
    """The producing replica stops (its lease is left to lapse, as a killed one's): the
    other adopts the response, replays its logged tokens and generates on after them;
    the full stream has every event once and the undisturbed text."""
    config = harness.config(redis_url=redis_server.url)
    one, two = (harness.start_gateway(config) for _ in range(2))
    try:
        first, second = _client(one), _client(two)
        reference = first.responses.create(model=MODEL, input="SLOW", max_output_tokens=100)
        started = first.responses.create(model=MODEL, input="SLOW", max_output_tokens=100, background=True)
        assert wait_for(lambda: _status(second, started.id) == "in_progress")
        time.sleep(25 * SLOW_STEP_S)
        harness.stop_gateway(one)
        events = list(second.responses.retrieve(started.id, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == f"response.{reference.status}"
        assert _text(events) == reference.output_text
        assert _wait_done(second, started.id).output_text == reference.output_text
    finally:
        for g in (one, two):
            if g in harness.gateways:
                harness.stop_gateway(g)


def test_a_lapsed_lease_of_a_live_producer_is_not_adopted(
    harness: Harness, redis_server: RedisServer
) -> None:
    """The producer's lease vanishes while it produces (as when its event loop stalls past
    the lease): its own replica's sweep must not adopt the response beside it, and its
    renewal takes the lease again -- one production, every event once, the undisturbed text."""
    gw = harness.start_gateway(harness.config(redis_url=redis_server.url))
    try:
        client = _client(gw)
        reference = client.responses.create(model=MODEL, input="SLOW", max_output_tokens=100)
        adopted = _adopted()
        started = client.responses.create(model=MODEL, input="SLOW", max_output_tokens=100, background=True)
        store = redis.Redis.from_url(redis_server.url)
        leases = 0
        while _status(client, started.id) not in TERMINAL:
            for key in store.scan_iter(match=f"*{started.id}:lease"):
                leases += store.delete(key)
            time.sleep(0.3)
        assert leases >= 3  # the lease was taken away again and again while it produced
        events = list(client.responses.retrieve(started.id, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert _text(events) == reference.output_text
        assert _adopted() == adopted
    finally:
        harness.stop_gateway(gw)


def _adopted() -> float:
    return (
        REGISTRY.get_sample_value("meshserve_gateway_background_responses_total", {"event": "adopted"}) or 0.0
    )


def test_cancel_from_the_other_replica_stops_the_generation(
    gateways: list[RunningGateway], harness: Harness
) -> None:
    one, two = (_client(g) for g in gateways)
    started = one.responses.create(model=MODEL, input="SLOW", max_output_tokens=150, background=True)
    assert wait_for(lambda: _status(two, started.id) == "in_progress")
    time.sleep(20 * SLOW_STEP_S)
    cancelled = two.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    worker: FakeWorker = harness.worker
    assert wait_for(lambda: any(rid.endswith(started.id) or started.id in rid for rid in worker.cancelled))
    events = list(one.responses.retrieve(started.id, stream=True))
    assert events[-1].type == "response.cancelled"
    assert one.responses.cancel(started.id).status == "cancelled"  # ended: unchanged


def _status(client: openai.OpenAI, response_id: str) -> str:
    return client.responses.retrieve(response_id).status or ""


def test_refusals_name_their_field(gateways: list[RunningGateway]) -> None:
    client = _client(gateways[0])
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(model=MODEL, input="hi", background=True, store=False)
    assert unstored.value.param == "store"
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as again:
        client.responses.retrieve(plain.id, stream=True)
    assert again.value.param == "stream"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_redis_down_is_a_503_naming_the_store(harness: Harness) -> None:
    from services.ports import free_port

    gw = harness.start_gateway(harness.config(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        client = _client(gw)
        with pytest.raises(openai.InternalServerError) as down:
            client.responses.create(model=MODEL, input="hi", background=True)
        assert down.value.status_code == 503 and "response store" in str(down.value.message)
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        ).choices
    finally:
        harness.stop_gateway(gw)


async def test_only_the_lease_holder_logs_events(redis_server: RedisServer) -> None:
    """The fencing check: an event is logged by the response's lease holder, or while
    nobody holds it; a producer whose lease another replica took writes nothing."""
    store = ResponseStore(redis_server.url, ttl_s=60)
    try:
        owner, rid = "owner", f"resp_{time.monotonic_ns()}"
        assert await store.append_event(owner, rid, 0, b"e0", holder="a")  # nobody holds it
        await store.begin_job(owner, rid, b"{}", "a", 3.0)
        assert await store.append_event(owner, rid, 1, b"e1", holder="a")
        assert await store.orphaned_jobs("b", 3.0) == []  # a's lease is live
        redis.Redis.from_url(redis_server.url).set(store.key(owner, rid) + ":lease", "b")  # b took it
        assert not await store.append_event(owner, rid, 2, b"e2-from-a", holder="a")
        assert await store.append_event(owner, rid, 2, b"e2", holder="b")
        assert [data for data, _ in await store.read_log(owner, rid)] == [b"e0", b"e1", b"e2"]
    finally:
        await store.close()


async def test_a_flagged_cancel_stops_a_generation_whose_task_cancels_are_lost(
    redis_server: RedisServer,
) -> None:
    """A cancel flagged in the store stops the producer's generation at its next event
    even when its task's cancel is lost: Python 3.11's asyncio.wait_for, through which
    redis-py writes each logged event, drops a cancel arriving as its inner call ends."""
    store = ResponseStore(redis_server.url, ttl_s=60)
    responses = background.BackgroundResponses(store, cast(Any, None), cast(Any, None), cast(Any, None))
    owner, rid, stop = "owner", f"resp_{time.monotonic_ns()}", background._Stop()

    async def written() -> None:
        return None

    async def events() -> AsyncIterator[bytes]:
        while True:
            await asyncio.wait_for(written(), 1.0)  # as each event's socket write
            yield b"event"

    async def produce() -> str:
        try:
            async for _ in background._until_stopped(events(), stop):
                pass
        except asyncio.CancelledError:
            return stop.reason
        return "ended"

    task = asyncio.create_task(produce())
    watcher = asyncio.create_task(responses._watch(owner, rid, stop, task))
    try:
        await asyncio.sleep(0.3)
        await store.request_cancel(owner, rid)
        done, _ = await asyncio.wait({task}, timeout=3.0)
        assert task in done and task.result() == "cancel"
    finally:
        task.cancel()
        watcher.cancel()
        await store.close()
