"""P/D hand-off between two real workers over loopback gRPC (and a prefix shared by one
decoder with another): a decode worker whose request names a prefill worker (`kv_source`)
has it prefill, pulls the KV (KvTransfer), imports it
and decodes; greedy output equals the prefill-free run. Every failure (prefill worker gone,
corrupted bytes, layout mismatch) falls back to a local prefill with the same output, is
counted by reason, and leaves no KV block in use on either worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY

from meshserve.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2_grpc
from tests.worker_svc.worker_kit import generate_one, settled_load, worker_process
from worker_svc.kv_connector import PrefillJob, TransferSource
from worker_svc.kv_grpc import GrpcKvConnector
from worker_svc.main import WorkerProcess

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(45)]  # 45 tokens: 11 full blocks of 4, chunked at 16


@contextlib.asynccontextmanager
async def worker(model_dir: Path, role: str, **config: object) -> AsyncIterator[WorkerProcess]:
    settings: dict[str, object] = {
        "worker_id": role,
        "role": role,
        "block_size": 4,
        "kv_cache_memory_mb": 8,
        "max_num_batched_tokens": 16,
        "kv_transfer_timeout_s": 20.0,
    } | config
    process = worker_process(model_dir, **settings)
    await process.start()
    try:
        yield process
    finally:
        await process.server.server.stop(0)
        await process.close()


def _request(request_id: str, source: kv_transfer_pb2.KvSource | None = None) -> common_pb2.GenerateRequest:
    request = common_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    )
    if source is not None:
        request.kv_source.CopyFrom(source)
    return request


async def _generate(address: str, request: common_pb2.GenerateRequest) -> tuple[list[int], int]:
    async with grpc.aio.insecure_channel(address) as channel:
        tokens: list[int] = []
        cached = 0
        async for reply in generate_one(worker_pb2_grpc.WorkerStub(channel), request):
            for delta in reply.deltas:
                tokens.extend(delta.token_ids)
            if reply.finished:
                cached = reply.usage.cached_tokens
        return tokens, cached


async def _idle(process: WorkerProcess) -> None:
    load = await settled_load(process, timeout=20)
    assert load.num_free_blocks == load.num_total_blocks, f"{process.config.role} leaked KV blocks"


def _count(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _source(process: WorkerProcess | None, transfer_id: str, address: str = "") -> kv_transfer_pb2.KvSource:
    address = address or f"127.0.0.1:{process.server.port}" if process is not None else address
    return kv_transfer_pb2.KvSource(worker_id="prefill", address=address, transfer_id=transfer_id)


def test_pd_hand_off_equals_local_prefill(model_dir: Path) -> None:
    async def main() -> None:
        async with (
            worker(model_dir, "prefill") as p,
            worker(model_dir, "decoder") as d,
            worker(model_dir, "decoder", worker_id="reference") as ref,
        ):
            expected, _ = await _generate(f"127.0.0.1:{ref.server.port}", _request("r"))
            imported = _count("meshserve_worker_kv_transfers_total", outcome="imported")
            sent = _count("meshserve_worker_kv_transfer_bytes_total", direction="sent")
            tokens, cached = await _generate(f"127.0.0.1:{d.server.port}", _request("a", _source(p, "t-a")))
            assert tokens == expected
            assert cached == 44, "the 11 full blocks came from the prefill worker"
            assert _count("meshserve_worker_kv_transfers_total", outcome="imported") == imported + 1
            assert _count("meshserve_worker_kv_transfer_bytes_total", direction="sent") > sent
            assert not p.engine.engine.kv.held, "pull-complete released the transfer"  # type: ignore[union-attr]
            await _idle(p)
            await _idle(d)

    asyncio.run(main())


def test_a_held_transfer_is_read_while_the_prefill_engine_is_busy(model_dir: Path) -> None:
    """A pull of a held transfer starts and ends while the prefill worker's engine thread
    is busy for 3 s (a long step): reading held blocks waits for no step boundary."""

    async def main() -> None:
        async with worker(model_dir, "prefill") as p:
            engine = p.engine
            assert engine is not None
            address = f"127.0.0.1:{p.server.port}"
            published = await GrpcKvConnector().publish(
                TransferSource("prefill", address, "t-busy"), PrefillJob("", tuple(PROMPT))
            )
            busy = asyncio.ensure_future(engine.call(lambda e: time.sleep(3.0)))
            await asyncio.sleep(0.2)  # the engine thread is now inside the 3 s call
            started = time.monotonic()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
                pull = kv_transfer_pb2.PullRequest(transfer_id="t-busy", blocks_per_chunk=4)
                blocks = [b.index async for chunk in stub.Pull(pull) for b in chunk.blocks]
            assert time.monotonic() - started < 1.5 and not busy.done()
            assert blocks == list(range(len(published.block_hashes))) == list(range(11))
            await busy
            await _idle(p)

    asyncio.run(main())


def test_a_decoder_pulls_the_prefix_another_decoder_holds(model_dir: Path) -> None:
    """Decoders sharing KV (scheduler_svc/kv_share.py): the holder publishes the first 33
    prompt tokens (its 8 cached blocks and one token computed past them), the other decoder
    pulls those blocks and computes the rest: greedy output equal to a run on its own."""

    async def main() -> None:
        async with worker(model_dir, "decoder", worker_id="holder") as a, worker(model_dir, "decoder") as b:
            holder = f"127.0.0.1:{a.server.port}"
            expected, _ = await _generate(holder, _request("first"))  # the holder caches the prompt
            source = kv_transfer_pb2.KvSource(
                worker_id="holder", address=holder, transfer_id="share-1", num_prompt_tokens=33
            )
            tokens, cached = await _generate(f"127.0.0.1:{b.server.port}", _request("second", source))
            assert tokens == expected
            assert cached == 32, "the 8 shared blocks came from the holder; the rest computed here"
            assert not a.engine.engine.kv.held  # type: ignore[union-attr]
            await _idle(a)
            await _idle(b)

    asyncio.run(main())


@pytest.mark.parametrize("fault", ["gone", "corrupt", "layout"])
def test_failed_hand_off_falls_back_with_the_same_output(model_dir: Path, fault: str) -> None:
    """The prefill worker unreachable, a corrupted block, or another block size: the
    decoder prefills itself, the client sees the same tokens, the reason is counted."""
    reason = {"gone": "unavailable", "corrupt": "checksum", "layout": "layout"}[fault]
    prefill_config: dict[str, object] = {"block_size": 8} if fault == "layout" else {}

    async def main() -> None:
        async with worker(model_dir, "prefill", **prefill_config) as p, worker(model_dir, "decoder") as d:
            expected, _ = await _generate(f"127.0.0.1:{p.server.port}", _request("r"))
            assert d.decoder is not None and d.decoder.kv_importer is not None
            if fault == "corrupt":
                d.decoder.kv_importer.connector = GrpcKvConnector(fault="corrupt")
            address = "127.0.0.1:1" if fault == "gone" else ""
            before = _count("meshserve_worker_kv_transfer_fallbacks_total", reason=reason)
            tokens, _ = await _generate(f"127.0.0.1:{d.server.port}", _request("a", _source(p, "t", address)))
            assert tokens == expected
            assert _count("meshserve_worker_kv_transfer_fallbacks_total", reason=reason) == before + 1
            await _idle(d)
            for _ in range(100):  # the fallback's Release reaches the prefill worker soon after
                if not p.engine.engine.kv.held:  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.05)
            await _idle(p)

    asyncio.run(main())


def test_pull_of_unknown_transfer_is_not_found_and_bad_prefill_is_refused(model_dir: Path) -> None:
    async def main() -> None:
        async with worker(model_dir, "prefill") as p:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{p.server.port}") as channel:
                stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Pull(kv_transfer_pb2.PullRequest(transfer_id="nope")):
                        pass
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Prefill(kv_transfer_pb2.PrefillRequest(transfer_id="x"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "prompt_token_ids" in (err.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Prefill(
                        kv_transfer_pb2.PrefillRequest(transfer_id="x", prompt_token_ids=[10**7])
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await _idle(p)

    asyncio.run(main())


class _HungPrefill(kv_transfer_pb2_grpc.KvTransferServicer):
    """A prefill worker that takes calls and never answers (as a SIGSTOPped one whose
    kernel still accepts the connection): the failure a live worker cannot be made to show
    in-process. Counts the Prefill calls it got."""

    def __init__(self) -> None:
        self.calls = 0

    async def Prefill(self, request: kv_transfer_pb2.PrefillRequest, context: object) -> None:
        self.calls += 1
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def _hung_prefill() -> AsyncIterator[tuple[str, _HungPrefill]]:
    server = grpc.aio.server()
    servicer = _HungPrefill()
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)


def test_hand_off_past_its_estimate_falls_back_early(model_dir: Path) -> None:
    """The scheduler expected 200 ms; the prefill worker hangs. The decoder gives up after
    twice the estimate plus 0.5 s (not its 20 s timeout), prefills itself, same tokens."""

    async def main() -> None:
        async with _hung_prefill() as (address, hung), worker(model_dir, "decoder") as d:
            expected, _ = await _generate(f"127.0.0.1:{d.server.port}", _request("r"))
            before = _count("meshserve_worker_kv_transfer_fallbacks_total", reason="timeout")
            source = _source(None, "t-hung", address)
            source.expected_ms = 200
            started = time.monotonic()
            tokens, _ = await _generate(f"127.0.0.1:{d.server.port}", _request("a", source))
            assert time.monotonic() - started < 5.0
            assert tokens == expected and hung.calls == 1
            assert _count("meshserve_worker_kv_transfer_fallbacks_total", reason="timeout") == before + 1
            await _idle(d)

    asyncio.run(main())


def test_no_room_falls_back_before_the_prefill_worker_works(model_dir: Path) -> None:
    """The decoder's free blocks cannot take the prompt's KV: it falls back ("import")
    without calling the prefill worker, then prefills itself once blocks free up."""

    async def main() -> None:
        async with _hung_prefill() as (address, hung), worker(model_dir, "decoder") as d:
            expected, _ = await _generate(f"127.0.0.1:{d.server.port}", _request("r"))
            engine = d.engine
            assert engine is not None

            def hog(e: Any) -> int:  # on the engine thread: the free count is current
                free = e.block_manager.num_free_blocks()  # leave 5 free blocks; 11 are needed
                return int(e.kv.reserve_import("hog", list(range(1000, 1000 + 4 * (free - 5) + 1)), ()))

            await engine.call(hog)
            before = _count("meshserve_worker_kv_transfer_fallbacks_total", reason="import")
            run = asyncio.ensure_future(
                _generate(f"127.0.0.1:{d.server.port}", _request("a", _source(None, "t-room", address)))
            )
            for _ in range(200):
                if _count("meshserve_worker_kv_transfer_fallbacks_total", reason="import") > before:
                    break
                await asyncio.sleep(0.05)
            assert _count("meshserve_worker_kv_transfer_fallbacks_total", reason="import") == before + 1
            await engine.call(lambda e: e.kv.release_import("hog"))
            tokens, _ = await run
            assert tokens == expected and hung.calls == 0
            await _idle(d)

    asyncio.run(main())
