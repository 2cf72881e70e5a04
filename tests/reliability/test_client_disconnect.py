"""Client disconnect mid-stream → the worker aborts the request: its KV blocks are freed
and nothing stays running (fast; the soak suite repeats it with many clients)."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.mesh import RunningMesh, chat_body, report, stream_chat

LONG = 1000  # tokens asked for: far more than the stream lives


def test_disconnect_mid_stream_aborts_on_the_worker(mesh: RunningMesh) -> None:
    """Read a few chunks of a long stream, drop the connection, and the worker reports
    num_running 0 and kv_usage 0 shortly after; the next request is served."""
    mesh.wait_kv_idle()
    before = {name: mesh.worker_load(name).num_finished for name in mesh.decoders}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            result = await stream_chat(
                client, mesh.gateway_url, chat_body(max_tokens=LONG, ignore_eos=True), stop_after_chunks=3
            )
        assert result.status == 200 and result.chunks >= 3, result
        assert not result.done

    asyncio.run(run())
    start = time.monotonic()
    busy = [n for n in mesh.decoders if mesh.worker_load(n).num_running or mesh.worker_load(n).kv_usage]
    loads = mesh.wait_kv_idle(timeout=15)
    freed_s = time.monotonic() - start
    generated = {n: loads[n].num_finished - before[n] for n in mesh.decoders}
    # Aborted requests are not counted as finished by the engine: nothing ran to the end.
    assert all(v == 0 for v in generated.values()), generated
    report(f"disconnect: KV freed {freed_s:.2f}s after the client left (busy right after: {busy})")
    reply = httpx.post(mesh.gateway_url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=60)
    assert reply.status_code == 200, reply.text
