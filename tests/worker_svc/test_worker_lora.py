"""A real worker with LoRA over gRPC: `model` naming an adapter runs under it (== PEFT's
greedy generate), unknown names are NOT_FOUND, LoadLora / UnloadLora change and report
the adapters, an unfit directory is INVALID_ARGUMENT naming it and changes
nothing, and heartbeats would carry the state (`lora_state`)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from meshserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.lora_kit import base_model, build_adapters, greedy, peft_greedy
from tests.worker_svc.worker_kit import RequestFailed, generate_tokens, run_worker

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64]
MAX_TOKENS = 8


def _request(rid: str, model: str) -> common_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return common_pb2.GenerateRequest(request_id=rid, model=model, prompt_token_ids=PROMPT, sampling=sampling)


def test_worker_serves_and_manages_adapters(model_dir: Path, tmp_path: Path) -> None:
    adapters = build_adapters(model_dir, tmp_path, ["ad-all", "ad-attn"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 4}')
    base_name = model_dir.name

    async def body(stub: worker_pb2_grpc.WorkerStub) -> dict[str, object]:
        seen: dict[str, object] = {}
        seen["ad-all"] = (await generate_tokens(stub, _request("a", "ad-all")))[0]
        seen["base"] = (await generate_tokens(stub, _request("b", base_name)))[0]
        with pytest.raises(RequestFailed) as unknown:
            await generate_tokens(stub, _request("c", "ad-attn"))
        seen["unknown"] = unknown.value
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.LoadLora(worker_pb2.LoadLoraRequest(name="broken", path=str(bad)), timeout=30)
        seen["refused"] = refused.value
        seen["loaded"] = await stub.LoadLora(
            worker_pb2.LoadLoraRequest(name="ad-attn", path=adapters["ad-attn"]), timeout=30
        )
        seen["ad-attn"] = (await generate_tokens(stub, _request("d", "ad-attn")))[0]
        seen["unloaded"] = await stub.UnloadLora(worker_pb2.UnloadLoraRequest(name="ad-all"), timeout=30)
        return seen

    seen, load = run_worker(
        model_dir,
        body,
        max_loras=1,
        lora_modules=(f"ad-all={adapters['ad-all']}",),
        enable_runtime_lora_updating=True,
        dtype="float32",  # the reference's (auto is bf16 on some hosts)
    )
    base = greedy(base_model(model_dir), PROMPT, MAX_TOKENS)
    assert seen["base"] == base
    for name in ("ad-all", "ad-attn"):
        want = peft_greedy(model_dir, adapters[name], PROMPT, MAX_TOKENS)
        assert want != base
        assert seen[name] == want, name
    unknown = seen["unknown"]
    assert isinstance(unknown, RequestFailed) and unknown.code() == grpc.StatusCode.NOT_FOUND
    assert "ad-attn" in unknown.details()
    refused = seen["refused"]
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'broken'" in (refused.details() or "")
    assert list(seen["loaded"].loaded) == ["ad-all", "ad-attn"]  # type: ignore[attr-defined]
    unloaded = seen["unloaded"]
    assert list(unloaded.loaded) == ["ad-attn"] and unloaded.num_loads == 2  # type: ignore[attr-defined]
    assert unloaded.num_evictions == 1  # type: ignore[attr-defined]
    assert load.num_free_blocks == load.num_total_blocks


def test_runtime_updating_off_by_default(model_dir: Path, tmp_path: Path) -> None:
    async def body(stub: worker_pb2_grpc.WorkerStub) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.LoadLora(worker_pb2.LoadLoraRequest(name="x", path=str(tmp_path)), timeout=30)
        return exc.value

    error, _ = run_worker(model_dir, body, max_loras=1)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
