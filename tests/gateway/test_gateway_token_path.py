"""The token path: Route → the gateway's GenerateStream to the worker → in-process
detokenization → Release. Failover before the first token, migration after it,
leases going back to the replica that issued them, scheduler replicas, and the
tokenizer fetched once per gateway."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from gateway_fakes import (
    CACHED_TOKENS,
    DEFAULT_WORKER,
    MODEL,
    FakeScheduler,
    FakeServer,
    Harness,
    decode,
    encode,
    keyword_text,
    start_fake,
    wait_for,
)

from meshserve.v1 import scheduler_pb2_grpc
from services.ports import free_port

CHAT = "/v1/chat/completions"
HELLO0 = "Hello from choice 0! The quick brown fox jumps over the lazy dog."


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def assert_released(scheduler: FakeScheduler, request_id: str, count: int = 1) -> list[str]:
    """`count` leases were issued for `request_id` and every one was released."""
    leases = scheduler.leases_of(request_id)
    assert len(leases) == count, leases
    assert wait_for(lambda: set(leases) <= set(scheduler.released)), f"leases {leases} not released"
    return leases


def sse_events(reply: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]


def stream_text(events: list[str]) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def post(url: str, body: dict[str, Any]) -> tuple[int, list[str] | dict[str, Any]]:
    """POSTs a chat completion; (status, SSE events) when streaming, else (status, JSON)."""
    with httpx.Client(base_url=url, timeout=20) as http:
        if body.get("stream"):
            with http.stream("POST", CHAT, json=body) as reply:
                return reply.status_code, sse_events(reply)
        reply = http.post(CHAT, json=body)
        return reply.status_code, reply.json()


# ------------------------------------------------------------------------ failover


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_worker_lost_before_first_token_fails_over(harness: Harness, gw_url: str, stream: bool) -> None:
    """(a) The first worker's stream breaks (its server is killed) while the request
    waits for its first token: the gateway routes again, excluding that worker, and
    the client sees a normal response from the other worker. Both leases go back."""
    with harness.extra_worker("doomed", hold=True) as doomed, ThreadPoolExecutor(1) as pool:
        future = pool.submit(post, gw_url, chat(stream=stream))
        assert wait_for(lambda: bool(doomed.worker.requests), timeout=10), "never reached the doomed worker"
        request_id = doomed.worker.last_request.request_id
        harness.kill_worker(doomed)
        status, body = future.result(timeout=30)
    assert status == 200, body
    if stream:
        assert isinstance(body, list) and body[-1] == "[DONE]"
        assert stream_text(body) == HELLO0
        assert all("error" not in json.loads(e) for e in body[:-1])
    else:
        assert isinstance(body, dict) and body["choices"][0]["message"]["content"] == HELLO0
    routes = harness.scheduler.routes_of(request_id)
    assert [list(r.exclude_worker_ids) for r in routes] == [[], ["doomed"]]
    assert harness.worker.last_request.request_id == request_id
    assert request_id in harness.worker.completed
    first, second = assert_released(harness.scheduler, request_id, count=2)
    assert harness.scheduler.leases[first][1] == "doomed"
    assert harness.scheduler.leases[second][1] == DEFAULT_WORKER
    assert harness.worker.last_request.lease_id == second


def test_worker_refusing_unavailable_fails_over(harness: Harness, http: httpx.Client) -> None:
    """A worker that refuses the request with UNAVAILABLE (draining) is excluded too."""
    with harness.extra_worker("draining", draining=True) as draining:
        reply = http.post(CHAT, json=chat())
        assert reply.status_code == 200, reply.text
        request_id = draining.worker.last_request.request_id
    assert reply.json()["choices"][0]["message"]["content"] == HELLO0
    routes = harness.scheduler.routes_of(request_id)
    assert [list(r.exclude_worker_ids) for r in routes] == [[], ["draining"]]
    assert_released(harness.scheduler, request_id, count=2)


def test_failover_gives_up_after_max_retries(harness: Harness) -> None:
    """With max_retries=0 a refused request is not routed again: 503 naming the worker."""
    with (
        harness.extra_worker("draining", draining=True) as draining,
        harness.gateway(max_retries=0) as gw,
        httpx.Client(base_url=gw.url, timeout=20) as http,
    ):
        reply = http.post(CHAT, json=chat())
        assert reply.status_code == 503, reply.text
        assert "draining" in reply.json()["error"]["message"]
        request_id = draining.worker.last_request.request_id
    assert len(harness.scheduler.routes_of(request_id)) == 1
    assert_released(harness.scheduler, request_id)


def test_evicted_embeddings_route_again_with_force_encode(harness: Harness, http: httpx.Client) -> None:
    """FAILED_PRECONDITION from the worker (image embeddings evicted): the gateway routes
    once more with force_encode (same worker allowed), and the request succeeds."""
    reply = http.post(CHAT, json=chat("EVICTED"))
    assert reply.status_code == 200, reply.text
    request_id = reply.json()["id"]
    routes = harness.scheduler.routes_of(request_id)
    assert [(list(r.exclude_worker_ids), r.force_encode) for r in routes] == [([], False), ([], True)]
    assert_released(harness.scheduler, request_id, count=2)


def _stream_then_kill(
    harness: Harness, http: httpx.Client, worker: Any, body: dict[str, Any], before: int = 4
) -> list[str]:
    """Streams `body`, kills `worker` after `before` SSE events, returns every event."""
    with http.stream("POST", CHAT, json=body, timeout=15) as reply:
        assert reply.status_code == 200
        lines = (line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))
        events = [next(lines) for _ in range(before)]
        harness.kill_worker(worker)
        return events + list(lines)


def test_worker_lost_after_tokens_migrates(harness: Harness, http: httpx.Client) -> None:
    """(b) The worker dies after tokens were streamed: the gateway routes again (the dead
    worker excluded) and sends the prompt plus the tokens so far; the new worker goes on
    after them and the client's stream is seamless: no error, no repeated or missing
    text, usage counts every token once; both leases go back."""
    body = chat("SLOW", stream=True, max_tokens=40, stream_options={"include_usage": True})
    with harness.extra_worker("fragile") as fragile:
        events = _stream_then_kill(harness, http, fragile, body)
        sent_before = list(fragile.worker.last_request.prompt_token_ids)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    expected = keyword_text("SLOW", 0)[:40]
    assert stream_text(events) == expected
    request_id = chunks[0]["id"]
    routes = harness.scheduler.routes_of(request_id)
    assert [list(r.exclude_worker_ids) for r in routes] == [[], ["fragile"]]
    resumed = harness.worker.last_request
    assert resumed.request_id == request_id and list(resumed.prompt_token_ids) == sent_before
    assert len(resumed.resumed) == 1 and resumed.resumed[0].index == 0 and not resumed.resumed[0].finished
    assert decode(list(resumed.resumed[0].token_ids)) == expected[: len(resumed.resumed[0].token_ids)]
    assert len(resumed.resumed[0].token_ids) >= 3
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert_released(harness.scheduler, request_id, count=2)


def test_migration_keeps_every_choice_and_skips_ended_ones(harness: Harness, http: httpx.Client) -> None:
    """n=2, choice 1 cut short by a stop string before the worker dies: the migrated
    request carries both choices' tokens, choice 1 marked finished (not run again);
    choice 0 goes on seamlessly, choice 1 keeps its stop; no error for the client."""
    body = chat("ENDLESS", stream=True, max_tokens=60, n=2, stop=["choice 1!"])
    body["stream_options"] = {"include_usage": True}
    with harness.extra_worker("fragile") as fragile:
        events = _stream_then_kill(harness, http, fragile, body, before=60)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    assert texts[0] == decode(encode(keyword_text("ENDLESS", 0))[:60])
    assert texts[1] == "Hello from "
    assert finish == {0: "length", 1: "stop"}
    request_id = chunks[0]["id"]
    assert [list(r.exclude_worker_ids) for r in harness.scheduler.routes_of(request_id)] == [[], ["fragile"]]
    resumed = {r.index: r for r in harness.worker.last_request.resumed}
    assert resumed[1].finished and not resumed[0].finished
    assert chunks[-1]["usage"]["completion_tokens"] > 60


def test_only_worker_stream_reset_migrates_to_it_again(harness: Harness, http: httpx.Client) -> None:
    """A single worker whose stream breaks while it stays up (a connection reset): routing
    again without it finds no worker, so the gateway routes once more allowing it, and
    the request goes on there over a fresh stream -- no error for the client."""
    harness.scheduler.down.add(DEFAULT_WORKER)
    try:
        with harness.extra_worker("only", break_first_stream_after=4) as only:
            body = chat("SLOW", stream=True, max_tokens=20)
            with http.stream("POST", CHAT, json=body, timeout=15) as reply:
                assert reply.status_code == 200
                events = sse_events(reply)
            streams = only.worker.streams_opened
    finally:
        harness.scheduler.down.discard(DEFAULT_WORKER)
    assert events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1]), events
    assert stream_text(events) == keyword_text("SLOW", 0)[:20]
    request_id = json.loads(events[0])["id"]
    routes = harness.scheduler.routes_of(request_id)
    assert [list(r.exclude_worker_ids) for r in routes] == [[], ["only"], []]
    assert streams == 2
    assert_released(harness.scheduler, request_id, count=2)


@pytest.mark.parametrize("n", [1, 2])
def test_a_moved_request_goes_on_elsewhere_seamlessly_and_is_no_migration(harness: Harness, n: int) -> None:
    """A worker ends a request as moved after 3 tokens (as a P/D prefill worker moves its
    short streams before a long prefill): the gateway routes it again without that worker,
    with every choice's tokens so far, and the client's stream shows no seam. A move is no
    failure: it goes on with max_migrations=0, and counts as `moved`, not `migrated`."""
    body = chat("WORKER_MOVES", stream=True, n=n, stream_options={"include_usage": True})
    with (
        harness.extra_worker("mover") as mover,
        harness.gateway(max_migrations=0) as gw,
        httpx.Client(base_url=gw.url, timeout=20) as http,
    ):
        before = [_migrations(http, outcome) for outcome in ("moved", "migrated")]
        status, events = post(gw.url, body)
        assert status == 200
        moved, migrated = (
            _migrations(http, o) - b for o, b in zip(("moved", "migrated"), before, strict=True)
        )
        assert mover.worker.last_request.request_id == json.loads(events[0])["id"]
    assert isinstance(events, list) and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    texts = dict.fromkeys(range(n), "")
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {i: keyword_text("WORKER_MOVES", i) for i in range(n)}
    request_id = chunks[0]["id"]
    assert [list(r.exclude_worker_ids) for r in harness.scheduler.routes_of(request_id)] == [[], ["mover"]]
    resumed = harness.worker.last_request
    assert sorted(len(r.token_ids) for r in resumed.resumed) == [3] * n
    assert chunks[-1]["usage"]["completion_tokens"] == sum(len(encode(t)) for t in texts.values())
    assert (moved, migrated) == (1, 0)
    assert_released(harness.scheduler, request_id, count=2)


def _migrations(http: httpx.Client, outcome: str) -> float:
    """The gateway's meshserve_gateway_migrations_total{outcome} (0 before the first)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f'meshserve_gateway_migrations_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_migration_limit_ends_stream_with_error(harness: Harness) -> None:
    """With max_migrations=0 a worker lost after tokens ends the SSE stream with a clear
    error event and [DONE] (no hang, not routed again); its lease is released."""
    with (
        harness.extra_worker("fragile") as fragile,
        harness.gateway(max_migrations=0) as gw,
        httpx.Client(base_url=gw.url, timeout=20) as http,
    ):
        events = _stream_then_kill(harness, http, fragile, chat("SLOW", stream=True))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and "fragile" in error["message"], error
    assert "max_migrations=0" in error["message"], error
    assert stream_text(events[:-2]).startswith("tic")
    request_id = json.loads(events[0])["id"]
    assert len(harness.scheduler.routes_of(request_id)) == 1
    assert_released(harness.scheduler, request_id)


# ------------------------------------------------------------------ scheduler replicas


def test_release_carries_the_actual_cached_tokens(harness: Harness, http: httpx.Client) -> None:
    """The lease goes back with the worker's usage (cached and prompt tokens), so the
    scheduler can compare its prediction with what the worker really found cached."""
    reply = http.post(CHAT, json=chat("hello outcome"))
    assert reply.status_code == 200, reply.text
    (lease,) = assert_released(harness.scheduler, reply.json()["id"])
    assert wait_for(lambda: lease in harness.scheduler.outcomes)
    outcome = harness.scheduler.outcomes[lease]
    usage = reply.json()["usage"]
    assert outcome.cached_tokens == CACHED_TOKENS == usage["prompt_tokens_details"]["cached_tokens"]
    assert outcome.prompt_tokens == usage["prompt_tokens"]


def test_first_scheduler_replica_down(harness: Harness) -> None:
    """(d) scheduler_address lists a dead replica first: models, health and generation
    all go through the live one, and leases are released there."""
    dead = f"127.0.0.1:{free_port()}"
    address = f"{dead},{harness.sched_server.address}"
    with harness.gateway(scheduler_address=address) as gw, httpx.Client(base_url=gw.url, timeout=20) as http:
        assert http.get("/v1/models").status_code == 200
        assert http.get("/health").status_code == 200
        for stream in (False, True, False, True):  # the replica rotation starts at each one
            status, body = post(gw.url, chat(max_tokens=3, stream=stream))
            assert status == 200, body
            request_id = json.loads(body[0])["id"] if isinstance(body, list) else body["id"]
            assert_released(harness.scheduler, request_id)


@pytest.fixture
def second_scheduler(harness: Harness) -> Iterator[tuple[FakeScheduler, FakeServer]]:
    """A second live fake scheduler replica leasing the same workers."""
    scheduler = FakeScheduler(name="replica-b", workers=harness.scheduler.workers)
    server = harness.run(start_fake(scheduler, scheduler_pb2_grpc.add_SchedulerServicer_to_server))
    yield scheduler, server
    harness.run(server.server.stop(0))


def test_leases_go_back_to_the_replica_that_issued_them(
    harness: Harness, second_scheduler: tuple[FakeScheduler, FakeServer]
) -> None:
    """With two live replicas, Route alternates and every Release goes to the issuer."""
    replica_b, server_b = second_scheduler
    address = f"{harness.sched_server.address},{server_b.address}"
    with harness.gateway(scheduler_address=address) as gw:
        ids = []
        for _ in range(4):
            status, body = post(gw.url, chat(max_tokens=2))
            assert status == 200, body
            assert isinstance(body, dict)
            ids.append(body["id"])
    for scheduler in (harness.scheduler, replica_b):
        issued = [lease for request_id in ids for lease in scheduler.leases_of(request_id)]
        assert issued, f"{scheduler.name} issued no lease"
        assert wait_for(lambda s=scheduler, i=issued: set(i) <= set(s.released))  # type: ignore[misc]
    assert not set(harness.scheduler.released) & set(replica_b.leases)
    assert not set(replica_b.released) & set(harness.scheduler.leases)


# ------------------------------------------------------------------------ tokenizer


def test_tokenizer_fetched_once_per_gateway(harness: Harness) -> None:
    """Concurrent first requests share one GetTokenizer; later requests reuse it."""
    calls = harness.tokenizer.get_tokenizer_calls
    harness.tokenizer.get_tokenizer_delay_s = 0.3
    try:
        with harness.gateway() as gw, ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: post(gw.url, chat(max_tokens=2)), range(4)))
            assert [status for status, _ in results] == [200] * 4
            assert post(gw.url, chat(max_tokens=2))[0] == 200
            assert harness.tokenizer.get_tokenizer_calls == calls + 1
    finally:
        harness.tokenizer.get_tokenizer_delay_s = 0.0


def test_corrupt_tokenizer_files_are_503_then_fetched_again(harness: Harness) -> None:
    """Files failing their sha256 are refused (503 naming the tokenizer) and not cached:
    the next request fetches them again."""
    calls = harness.tokenizer.get_tokenizer_calls
    with harness.gateway() as gw, httpx.Client(base_url=gw.url, timeout=20) as http:
        harness.tokenizer.corrupt_files = True
        try:
            reply = http.post(CHAT, json=chat(max_tokens=2))
        finally:
            harness.tokenizer.corrupt_files = False
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["message"].startswith("tokenizer")
        reply = http.post(CHAT, json=chat(max_tokens=2))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == HELLO0[:2]
    assert harness.tokenizer.get_tokenizer_calls == calls + 2


def test_concurrent_requests_on_one_stream_get_their_own_output(harness: Harness, gw_url: str) -> None:
    """Requests multiplexed on the shared worker stream: each gets exactly its own
    output (the worker batches several requests' steps into one message)."""
    prompts = ["hi", "UNICODE", "JSON", "SLOW"]
    bodies = [chat(content, stream=i % 2 == 0, max_tokens=40) for i, content in enumerate(prompts)] * 3
    assert post(gw_url, chat(max_tokens=1))[0] == 200  # the gateway's stream to the worker is open
    opened = harness.worker.streams_opened
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda body: post(gw_url, body), bodies))
    for body, (status, reply) in zip(bodies, results, strict=True):
        assert status == 200, reply
        expected = decode(encode(keyword_text(body["messages"][0]["content"], 0))[:40])
        if isinstance(reply, list):
            assert stream_text(reply) == expected
        else:
            assert reply["choices"][0]["message"]["content"] == expected
    assert harness.worker.streams_opened == opened


def test_stale_model_list_is_refreshed_off_the_request_path(harness: Harness) -> None:
    """A model the gateway's cached list serves is answered from it even when the list
    is stale and the scheduler is slow to list its workers: the refresh runs in the
    background. A model the list lacks still waits for a fresh list, then 404."""
    scheduler = harness.scheduler
    with harness.gateway(models_cache_s=0.0) as gateway:
        assert post(gateway.url, chat(max_tokens=4))[0] == 200  # fills the cache
        gate = asyncio.Event()
        scheduler.list_workers_gate = gate
        try:
            calls = scheduler.list_workers_calls
            # Answered while ListWorkers hangs (before: waited on it, then 503 after 5 s).
            with httpx.Client(base_url=gateway.url, timeout=3) as http:
                assert http.post(CHAT, json=chat(max_tokens=4)).status_code == 200
            assert wait_for(lambda: scheduler.list_workers_calls > calls), "no background refresh"
            with ThreadPoolExecutor(1) as pool:
                unknown = pool.submit(post, gateway.url, {**chat(), "model": "no-such-model"})
                harness.loop.call_soon_threadsafe(gate.set)
                assert unknown.result(10)[0] == 404
            # The miss listed the workers itself (after the background refresh).
            assert scheduler.list_workers_calls >= calls + 2
        finally:
            scheduler.list_workers_gate = None
            harness.loop.call_soon_threadsafe(gate.set)


def test_health_that_sees_a_decoder_loads_its_tokenizer_before_any_request(harness: Harness) -> None:
    """The first request after the mesh reports ready fetches no tokenizer: the /health probe
    that finds a healthy decoder starts loading its model's (once), without waiting for it."""
    calls = harness.tokenizer.get_tokenizer_calls
    with harness.gateway() as gw, httpx.Client(base_url=gw.url, timeout=20) as http:
        assert http.get("/health").status_code == 200
        deadline = time.monotonic() + 10
        while harness.tokenizer.get_tokenizer_calls == calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert harness.tokenizer.get_tokenizer_calls == calls + 1, "no prefetch"
        assert http.get("/health").status_code == 200
        assert post(gw.url, chat(max_tokens=2))[0] == 200
    assert harness.tokenizer.get_tokenizer_calls == calls + 1
