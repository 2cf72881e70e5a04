"""A background response survives the death of the gateway producing it: two gateway
processes on one port (SO_REUSEPORT, as `launcher --num-gateways 2` starts them) sharing
the mesh's real Redis; the official openai SDK streams a background response, the
replica producing it is killed with SIGKILL mid-stream, and the client resumes the
stream with `starting_after` on the port: the other replica adopts the response and the
events go on with none lost or repeated, the text equal (greedy) to an undisturbed run.
Cancel works across replicas (KV blocks freed). The slow suite does the same at load."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

import openai
import pytest
import redis

from launcher.mesh import ServiceSpec
from services.ports import free_port
from tests.mesh import MODEL_NAME, RunningMesh, wait_gateway_healthy

pytestmark = pytest.mark.timeout(240)
NAMES = ("bg-gateway-a", "bg-gateway-b")


@pytest.fixture(scope="module")
def replicas(shared: RunningMesh) -> str:
    """Two gateway replicas on one port, sharing the mesh's Redis (extra processes of the
    shared mesh: one a test killed is revived before the next); their URL."""
    port = free_port()
    env = shared.specs["gateway"].env | {"MESHSERVE_PORT": str(port), "MESHSERVE_REUSE_PORT": "true"}
    for name in NAMES:
        shared.add_service(ServiceSpec(name, "gateway", port, dict(env), grpc=False, reuse_port=True))
    url = f"http://127.0.0.1:{port}"
    wait_gateway_healthy(url)
    return url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _producer(mesh: RunningMesh, response_id: str) -> str:
    """The replica holding the response's lease (its value names the process)."""
    client = redis.Redis.from_url(mesh.specs["gateway"].env["MESHSERVE_REDIS_URL"])
    keys = client.keys(f"meshserve:responses:*:{response_id}:lease")
    holder = client.get(keys[0]).decode() if keys else ""
    pid = int(holder.split(":")[1]) if holder else -1
    return next(name for name in NAMES if mesh.pid(name) == pid)


def _adopted_by(mesh: RunningMesh, response_id: str) -> set[str]:
    """The gateways that logged adopting ``response_id`` ("": any response)."""
    gateways = [name for name, spec in mesh.specs.items() if spec.module == "gateway"]
    line = f"background response {response_id}" if response_id else "background response "
    return {
        n for n in gateways if any(line in x and "adopted" in x for x in mesh.log_tail(n, 2000).splitlines())
    }


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


PROMPT = {"model": MODEL_NAME, "input": "Tell me a long story", "max_output_tokens": 64, "temperature": 0}


def test_sigkill_of_the_producing_gateway_loses_no_event(mesh: RunningMesh, replicas: str) -> None:
    # Long enough that the producer is still generating when it is killed (the tiny
    # model makes hundreds of tokens a second).
    prompt = PROMPT | {"max_output_tokens": 2000}
    client = _client(replicas)
    reference = client.responses.create(**prompt)
    assert len(reference.output_text) > 200
    seen: list[Any] = []
    killed = ""
    stream = client.responses.create(**prompt, background=True, stream=True)
    with contextlib.suppress(openai.APIConnectionError, openai.APIError):
        for event in stream:
            seen.append(event)
            if len(seen) == 2:
                killed = _producer(mesh, seen[0].response.id)
                mesh.kill(killed)  # SIGKILL mid-stream
    assert killed and mesh.wait_exit(killed, 10) == -signal.SIGKILL
    assert seen[-1].type != "response.completed"
    response_id = seen[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == f"response.{reference.status}"
    assert _adopted_by(mesh, response_id) - {killed}  # any gateway on the mesh's Redis may adopt it
    assert _text(events) == reference.output_text
    assert client.responses.retrieve(response_id).output_text == reference.output_text
    mesh.wait_kv_idle()


def test_cancel_on_either_replica_frees_the_kv_blocks(mesh: RunningMesh, replicas: str) -> None:
    """Eight long background responses keep the decoders busy for seconds (the tiny model
    alone would finish one before a cancel lands); the first is cancelled mid-generation
    from whichever replica the call reaches, the others after it; KV blocks all freed."""
    client = _client(replicas)
    started = [
        client.responses.create(**(PROMPT | {"max_output_tokens": 2000}), background=True) for _ in range(8)
    ]
    deadline = time.monotonic() + 30
    while client.responses.retrieve(started[0].id).status != "in_progress" and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled = client.responses.cancel(started[0].id)
    assert cancelled.status == "cancelled"
    events = list(client.responses.retrieve(started[0].id, stream=True))
    assert events[-1].type == "response.cancelled"
    assert sum(e.type == "response.output_text.delta" for e in events) < 1900  # stopped well short
    for other in started[1:]:
        ended = client.responses.cancel(other.id)
        assert ended.status in ("cancelled", "completed", "incomplete"), ended.error
    mesh.wait_kv_idle()


@pytest.mark.slow
def test_a_gateway_killed_under_background_load_loses_no_response(mesh: RunningMesh, replicas: str) -> None:
    """32 background responses at c=16; once one is in progress, the replica producing it
    is killed: 32/32 complete, each equal to its undisturbed answer, and one was adopted."""
    client = openai.AsyncOpenAI(base_url=replicas + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = [dict(PROMPT, input=f"Story number {i}", max_output_tokens=400) for i in range(32)]
    reference = [_client(replicas).responses.create(**p).output_text for p in prompts]
    started: list[str] = []
    first = asyncio.Event()

    async def one(p: dict[str, Any], gate: asyncio.Semaphore) -> str:
        async with gate:
            queued = await _retried(lambda: client.responses.create(**p, background=True))
            started.append(queued.id)
            first.set()
            while True:
                found = await _retried(lambda: client.responses.retrieve(queued.id))
                if found.status in ("completed", "incomplete", "failed", "cancelled"):
                    return found.output_text
                await asyncio.sleep(0.1)

    async def run() -> list[str]:
        gate = asyncio.Semaphore(16)
        tasks = [asyncio.create_task(one(p, gate)) for p in prompts]
        await first.wait()
        mesh.kill(_producer(mesh, started[0]))  # mid-generation: 400 tokens each, 16 at a time
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == reference
    assert _adopted_by(mesh, "")
    mesh.wait_kv_idle()


async def _retried(call: Any) -> Any:
    """``call()`` again after a connection the killed replica held broke (the port's
    other replica answers the next)."""
    for _ in range(20):
        try:
            return await call()
        except openai.APIConnectionError:
            await asyncio.sleep(0.2)
    return await call()
