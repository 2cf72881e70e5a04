"""KV events through a real redis-server: publisher layout, subscriber rebuild and gaps,
prefix routing fed by events, Redis outages, registry shared by scheduler replicas."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from meshserve.v1 import common_pb2
from scheduler_svc.kv_subscriber import KvSubscriber
from scheduler_svc.prefix_index import PrefixIndex
from services.kv_contract import STREAM_KEY, index_key, request_extra_keys, seq_key, tier_key
from services.redis_client import RedisServer, connect
from worker_svc.kv_events import KvEventPublisher

pytestmark = pytest.mark.timeout(60)


class Ev:
    def __init__(self, kind: str, hashes: list[int] | None = None) -> None:
        self.kind = kind
        self.block_hashes = hashes or []


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server this test may stop and restart (same port, no persistence)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


def restart(server: RedisServer) -> RedisServer:
    server.stop()
    return RedisServer(port=server.port).start()


def members(client: redis.Redis, worker_id: str) -> set[int]:
    return {int(m) for m in client.smembers(index_key(worker_id))}


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.02)


def test_request_extra_keys_convention() -> None:
    def item(identifier: str, offset: int) -> common_pb2.MultiModalItem:
        return common_pb2.MultiModalItem(identifier=identifier, offset=offset)

    assert request_extra_keys() == ()
    assert request_extra_keys("s", [item("img1", 3), item("img2", 9)]) == ("salt:s", "mm:img1", "mm:img2")
    # prompt order, whatever the order of the items; one key per distinct image
    assert request_extra_keys("", [item("b", 9), item("a", 3), item("b", 20)]) == ("mm:a", "mm:b")


def test_publisher_writes_stream_set_and_cursor(private_redis: RedisServer) -> None:
    client = redis.Redis.from_url(private_redis.url)
    pub = KvEventPublisher(private_redis.url, "w1")
    pub.start()
    pub.publish([Ev("stored", [1, 2, 3])])
    pub.publish([Ev("removed", [2]), Ev("stored", [4])])
    assert pub.wait_idle()
    assert members(client, "w1") == {1, 3, 4}
    entries = client.xrange(STREAM_KEY)
    fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in entries]
    assert [(f["seq"], f["kind"], f["hashes"]) for f in fields] == [
        ("1", "resync", ""),
        ("2", "stored", "1,2,3"),
        ("3", "removed", "2"),
        ("4", "stored", "4"),
    ]
    assert {f["worker_id"] for f in fields} == {"w1"} and {f["epoch"] for f in fields} == {pub.epoch}
    assert client.get(seq_key("w1")) == f"{pub.epoch}:4".encode()
    pub.publish([Ev("cleared")])
    assert pub.wait_idle()
    assert members(client, "w1") == set()
    pub.close()
    # A restarted worker (new publisher) starts from an empty set under a new epoch.
    client.sadd(index_key("w1"), 99)
    again = KvEventPublisher(private_redis.url, "w1")
    again.start()
    assert again.wait_idle()
    assert members(client, "w1") == set() and again.epoch != pub.epoch
    again.close()


def test_publisher_gathers_steps_into_one_transaction(private_redis: RedisServer) -> None:
    """Events published within the flush window are written together, each run of one
    kind as one stream entry (order kept across kinds): the block set is the same."""
    client = redis.Redis.from_url(private_redis.url)
    pub = KvEventPublisher(private_redis.url, "w1", flush_interval_s=1.0)
    pub.start()
    assert pub.wait_idle()  # the first write (resync) goes at once
    for step in range(5):
        pub.publish([Ev("stored", [10 + step])])
        time.sleep(0.02)  # engine steps apart: without the window, each its own write
    pub.publish([Ev("removed", [11])])
    pub.publish([Ev("stored", [20]), Ev("stored", [21])])
    assert pub.wait_idle()
    fields = [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(STREAM_KEY)]
    assert [(f["kind"], f["hashes"]) for f in fields] == [
        ("resync", ""),
        ("stored", "10,11,12,13,14"),
        ("removed", "11"),
        ("stored", "20,21"),
    ]
    assert members(client, "w1") == {10, 12, 13, 14, 20, 21}
    assert client.get(seq_key("w1")) == f"{pub.epoch}:4".encode()
    pub.close()


def test_publisher_wakes_its_writer_once_per_batch(private_redis: RedisServer) -> None:
    """Steps published while the writer gathers a batch do not wake it: a wake-up per
    engine step is a thread switch and an interpreter-lock hand-off taken from the engine
    thread for nothing (the writer waits out its window anyway)."""
    notified: list[int] = []  # notify() calls made by publish (the writer's own are its thread's)

    class CountingCondition(threading.Condition):
        def notify(self, n: int = 1) -> None:
            if threading.current_thread() is threading.main_thread():
                notified.append(n)
            super().notify(n)

    pub = KvEventPublisher(private_redis.url, "w1", flush_interval_s=1.0, autostart=False)
    pub._cond = CountingCondition()  # the publisher's only lock: publish() notifies through it
    pub.start()
    assert pub.wait_idle()
    notified.clear()
    for step in range(5):
        pub.publish([Ev("stored", [10 + step])])
        time.sleep(0.02)
    assert pub.wait_idle()
    assert len(notified) == 1  # the batch's first step
    assert members(redis.Redis.from_url(private_redis.url), "w1") == {10, 11, 12, 13, 14}
    pub.close()


def test_publisher_survives_redis_outage(private_redis: RedisServer) -> None:
    pub = KvEventPublisher(private_redis.url, "w1", retry_interval_s=0.1)
    pub.start()
    pub.publish([Ev("stored", [1, 2])])
    assert pub.wait_idle()
    private_redis.stop()
    started = time.monotonic()
    for i in range(50):
        pub.publish([Ev("stored", [100 + i])])  # never blocks the caller
    assert time.monotonic() - started < 0.5
    deadline = time.monotonic() + 5
    while pub.dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pub.dropped > 0
    pub.publish([Ev("removed", [1])])
    server = restart(private_redis)  # comes back empty: the publisher rewrites its set
    try:
        assert pub.wait_idle(10)
        client = redis.Redis.from_url(server.url)
        assert members(client, "w1") == {2, *range(100, 150)}
    finally:
        pub.close()
        server.cleanup()


async def test_subscriber_rebuilds_follows_and_resyncs_on_gaps(private_redis: RedisServer) -> None:
    sync = redis.Redis.from_url(private_redis.url)
    pub = KvEventPublisher(private_redis.url, "w1")
    pub.start()
    pub.publish([Ev("stored", [1, 2, 3])])
    assert await asyncio.to_thread(pub.wait_idle)
    index = PrefixIndex(speculative_ttl_s=0)
    client = connect(private_redis.url)
    sub = KvSubscriber(client, index, tracked=lambda w: w != "ignored")
    await sub.rebuild()
    assert index.match([1, 2, 3], ["w1"]) == {"w1": 3}
    pub.publish([Ev("removed", [3]), Ev("stored", [7])])
    assert await asyncio.to_thread(pub.wait_idle)
    await sub.poll_once(block_ms=100)
    assert index.match([1, 2, 3], ["w1"]) == {"w1": 2} and index.holds("w1", 7)
    # A gap in seq (an entry lost) makes the subscriber reload the worker's set.
    epoch, seq = index.cursor("w1") or ("", 0)
    sync.sadd(index_key("w1"), 42)
    sync.set(seq_key("w1"), f"{epoch}:{seq + 2}")
    sync.xadd(
        STREAM_KEY, {"worker_id": "w1", "epoch": epoch, "seq": seq + 2, "kind": "stored", "hashes": "42"}
    )
    await sub.poll_once(block_ms=100)
    assert index.holds("w1", 42) and index.cursor("w1") == (epoch, seq + 2)
    # Untracked workers are ignored.
    other = KvEventPublisher(private_redis.url, "ignored")
    other.start()
    other.publish([Ev("stored", [5])])
    assert await asyncio.to_thread(other.wait_idle)
    await sub.poll_once(block_ms=100)
    assert "ignored" not in index.workers()
    for p in (pub, other):
        await asyncio.to_thread(p.close)
    await client.aclose()


async def test_the_index_knows_which_blocks_sit_in_a_workers_tier(private_redis: RedisServer) -> None:
    """Offloaded blocks stay held and go in the worker's tier set, a load back (stored)
    takes them out, removed drops them: in Redis, in the index the stream feeds, and in
    the index a resync reloads."""
    sync = redis.Redis.from_url(private_redis.url)
    pub = KvEventPublisher(private_redis.url, "w1")
    pub.start()
    pub.publish([Ev("stored", [1, 2, 3, 4])])
    assert await asyncio.to_thread(pub.wait_idle)
    index = PrefixIndex(speculative_ttl_s=0)
    client = connect(private_redis.url)
    sub = KvSubscriber(client, index, tracked=lambda w: True)
    await sub.rebuild()
    pub.publish([Ev("offloaded", [2, 3, 4])])
    pub.publish([Ev("stored", [2]), Ev("removed", [4])])
    assert await asyncio.to_thread(pub.wait_idle)
    await sub.poll_once(block_ms=100)
    assert members(sync, "w1") == {1, 2, 3}
    assert {int(m) for m in sync.smembers(tier_key("w1"))} == {3}
    assert index.match([1, 2, 3, 4], ["w1"]) == {"w1": 3}
    assert index.tier_blocks("w1", [1, 2, 3]) == 1
    fresh = PrefixIndex(speculative_ttl_s=0)
    await KvSubscriber(client, fresh, tracked=lambda w: True).rebuild()
    assert fresh.match([1, 2, 3, 4], ["w1"]) == {"w1": 3} and fresh.tier_blocks("w1", [1, 2, 3]) == 1
    # A resync rewrites both sets from the publisher's mirror.
    sync.delete(tier_key("w1"), index_key("w1"))
    sync.set(seq_key("w1"), "someone-else:1")
    pub.publish([Ev("offloaded", [1])])
    assert await asyncio.to_thread(pub.wait_idle)
    assert members(sync, "w1") == {1, 2, 3}
    assert {int(m) for m in sync.smembers(tier_key("w1"))} == {1, 3}
    await asyncio.to_thread(pub.close)
    await client.aclose()


async def test_prefix_routing_follows_kv_events(
    start_scheduler: Any, start_worker: Any, private_redis: RedisServer
) -> None:
    # No routing-time speculation: what the scheduler knows of the workers' caches comes
    # from the KV events they publish when they run a request.
    sched = await start_scheduler(redis_url=private_redis.url, speculative_ttl_s=0)
    workers = [await start_worker(f"w{i}", sched, redis_url=private_redis.url) for i in range(3)]
    await sched.wait_for(lambda: sched.core.subscriber is not None and sched.core.subscriber.connected)
    prompt = list(range(1, 33))  # 8 blocks of 4
    before = await sched.route(prompt)
    assert before.reason == "score" and before.predicted_cached_tokens == 0
    await sched.release(before.lease_id)
    route, responses = await sched.run(prompt)  # routed, then run on the worker
    first = route.worker_id
    assert responses[0].worker_id == first and responses[-1].finished
    owner = next(w for w in workers if w.worker_id == first)
    hashes = owner.prompt_hashes(prompt)
    await sched.wait_for(lambda: sched.core.index.holds(first, hashes[-1]))
    for turn in range(4):
        follow_up = [*prompt, 100 + turn, 101, 102, 103]
        reply = await sched.route(follow_up)
        assert reply.worker_id == first
        assert reply.reason == "prefix" and reply.predicted_cached_tokens == 32
        await sched.release(reply.lease_id)
    assert sched.core.index.match(hashes, [first]) == {first: 8}
    # The same tokens under another cache salt share nothing with it.
    salted = owner.prompt_hashes(prompt, cache_salt="tenant-b")
    assert sched.core.index.match(salted, [first]) == {first: 0}
    reply = await sched.route(prompt, cache_salt="tenant-b")
    assert reply.reason != "prefix" and reply.predicted_cached_tokens == 0


async def test_redis_outage_serving_continues_then_index_rebuilt(
    start_scheduler: Any, start_worker: Any, private_redis: RedisServer
) -> None:
    sched = await start_scheduler(redis_url=private_redis.url, speculative_ttl_s=0)
    worker = await start_worker("w1", sched, redis_url=private_redis.url)
    worker.publisher._retry_interval_s = 0.1
    sub = sched.core.subscriber
    assert sub is not None
    await sched.wait_for(lambda: sub.connected)
    await sched.run(list(range(8)))
    before = worker.prompt_hashes(list(range(8)))
    await sched.wait_for(lambda: sched.core.index.holds("w1", before[-1]))
    private_redis.stop()
    await sched.wait_for(lambda: not sub.connected)
    # Degraded mode: still routing on local state (heartbeats come over gRPC).
    for i in range(3):
        route, responses = await sched.run([50 + i] * 8)
        assert route.worker_id == "w1" and responses[-1].finished
    assert sched.core.registry.get("w1").healthy
    assert sched.inflight("w1") == 0
    rebuilds = sub.rebuilds
    server = restart(private_redis)
    try:
        await sched.wait_for(lambda: sub.connected and sub.rebuilds > rebuilds, timeout=10)
        # Blocks stored while Redis was down reach the index through the publisher's resync.
        during = worker.prompt_hashes([52] * 8)
        await sched.wait_for(lambda: sched.core.index.holds("w1", during[-1]), timeout=10)
        assert sched.core.index.holds("w1", before[-1])
    finally:
        server.cleanup()


async def test_worker_down_drops_index_entries_and_resyncs_on_return(
    start_scheduler: Any, start_worker: Any, private_redis: RedisServer
) -> None:
    sched = await start_scheduler(redis_url=private_redis.url, speculative_ttl_s=0)
    worker = await start_worker("w1", sched, redis_url=private_redis.url)
    await sched.run(list(range(8)))
    await sched.wait_for(lambda: sched.core.index.num_blocks("w1") == 2)
    worker.hang()
    await sched.wait_for(lambda: not sched.core.registry.get("w1").healthy)
    assert sched.core.index.num_blocks("w1") == 0
    worker.resume()
    await sched.wait_for(lambda: sched.core.index.num_blocks("w1") == 2)


async def test_registry_shared_by_scheduler_replicas(
    start_scheduler: Any, start_worker: Any, private_redis: RedisServer
) -> None:
    first = await start_scheduler(redis_url=private_redis.url)
    second = await start_scheduler(redis_url=private_redis.url)
    worker = await start_worker("w1", first)
    await second.wait_for(lambda: second.core.registry.get("w1") is not None)
    # The second replica routes to a worker that only ever talked to the first one ...
    reply = await second.route([1, 2, 3])
    assert reply.worker_id == "w1" and reply.worker_address == worker.address
    # ... and the lease is the second replica's: only it can release it.
    assert second.inflight("w1") == 1 and first.inflight("w1") == 0
    assert await first.release(reply.lease_id) == 0
    assert await second.release(reply.lease_id) == 1
    assert second.inflight("w1") == 0
    route, responses = await second.run([4, 5, 6])
    assert route.worker_id == "w1" and responses[0].worker_id == "w1" and responses[-1].finished
