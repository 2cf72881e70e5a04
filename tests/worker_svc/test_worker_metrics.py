"""A decoder's /metrics load gauges follow its engine: read from the engine's stats when
scraped (no refresh timer), the same load its heartbeats carry."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import httpx

from meshserve.v1 import common_pb2, worker_pb2_grpc
from services.ports import free_port
from tests.mesh import unlabelled_samples
from tests.worker_svc.worker_kit import generate_one, settled_load, worker_process

PROMPT = [5, 17, 33, 8, 90, 41, 7]


def _request(request_id: str, max_tokens: int) -> common_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return common_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling)


async def _gauges(port: int) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
    return unlabelled_samples(text, "meshserve_worker_")


def test_load_gauges_are_read_when_scraped(tiny_model_dir: Path) -> None:
    async def main() -> None:
        worker = worker_process(tiny_model_dir, worker_id="m", kv_cache_memory_mb=8, metrics_port=free_port())
        await worker.start()
        port = worker.server.metrics_port
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                replies = 0
                stream = generate_one(stub, _request("long", 1000))
                async with contextlib.aclosing(stream):  # closing cancels the call: an abort
                    async for _ in stream:
                        replies += 1
                        if replies == 3:  # mid-stream: running, holding KV blocks
                            running = await _gauges(port)
                            break
                assert running["num_running"] == 1 and running["kv_usage"] > 0, running
                await settled_load(worker)
                async for _ in generate_one(stub, _request("short", 4)):
                    pass
                await settled_load(worker)
                idle = await _gauges(port)
                assert idle["num_running"] == 0 and idle["num_waiting"] == 0 and idle["kv_usage"] == 0, idle
                assert idle["num_finished"] == 1, idle  # the aborted request did not finish
                assert idle["lora_resident"] == 0, idle  # LoRA off
        finally:
            await worker.server.server.stop(0)
            await worker.close()

    asyncio.run(main())
