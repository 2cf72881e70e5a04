"""The Tokenizer service over a real gRPC server on an ephemeral port, via generated stubs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.config import ServerConfig
from services.rpc import check_health
from services.server import GrpcServer
from tokenizer_svc.renderer import Renderer
from tokenizer_svc.servicer import SERVICE, TokenizerServicer
from tokenizer_svc.tokenizer_files import tokenizer_files

Stub = tokenizer_pb2_grpc.TokenizerStub
MESSAGES = [{"role": "user", "content": "Hello there 🎉"}]
ROOT = Path(__file__).resolve().parents[2]


async def test_health_serving_after_load(address: str) -> None:
    assert await check_health(address)
    assert await check_health(address, SERVICE)


async def test_tokenizer_info(stub: Stub, renderer: Renderer, tiny_model_dir: Path) -> None:
    info = await stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
    assert info.model == tiny_model_dir.name
    assert info.vocab_size == renderer.vocab_size
    assert list(info.eos_token_ids) == renderer.eos_token_ids
    assert info.max_model_len == 2048 and info.has_chat_template
    assert not info.token_strs


async def test_render_chat(stub: Stub, renderer: Renderer) -> None:
    request = tokenizer_pb2.RenderChatRequest(messages_json=json.dumps(MESSAGES))
    reply = await stub.RenderChat(request)
    expected = renderer.render_chat(MESSAGES)
    assert list(reply.prompt_token_ids) == expected.prompt_token_ids
    assert reply.prompt_text == expected.prompt_text and not reply.mm_items
    request.add_generation_prompt = False
    assert not (await stub.RenderChat(request)).prompt_text.endswith("assistant\n")


async def test_tokenize_detokenize_round_trip(stub: Stub) -> None:
    text = "Grüße, 世界! 🎉"
    tokens = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, return_token_strs=True))
    assert len(tokens.token_strs) == len(tokens.token_ids) > 0 and tokens.max_model_len == 2048
    reply = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=tokens.token_ids))
    assert reply.text == text


async def _expect_invalid(call: object, *fields: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    details = info.value.details() or ""
    for field in fields:
        assert field in details, details
    return details


async def test_invalid_argument_names_the_field(stub: Stub) -> None:
    bad_role = json.dumps([{"role": "robot", "content": "hi"}])
    await _expect_invalid(
        stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages_json=bad_role)), "messages[0].role"
    )
    await _expect_invalid(stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages_json="[{")), "messages")
    both = tokenizer_pb2.RenderChatRequest(
        messages_json=json.dumps(MESSAGES), add_generation_prompt=True, continue_final_message=True
    )
    await _expect_invalid(stub.RenderChat(both), "add_generation_prompt", "continue_final_message")
    template = tokenizer_pb2.RenderChatRequest(messages_json=json.dumps(MESSAGES), chat_template="{{ 1 }}")
    await _expect_invalid(stub.RenderChat(template), "chat_template")
    tools = tokenizer_pb2.RenderChatRequest(messages_json=json.dumps(MESSAGES), tools_json='{"x": 1}')
    await _expect_invalid(stub.RenderChat(tools), "tools")
    await _expect_invalid(stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=[10**6])), "token_ids")
    await _expect_invalid(stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=[-3])), "token_ids")


async def test_unknown_model_is_not_found(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(tokenizer_pb2.TokenizeRequest(model="gpt-17", text="x"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unavailable_until_loaded() -> None:
    server = GrpcServer("tokenizer-loading", ServerConfig(port=0, drain_timeout_s=0.5))
    server.add_service(SERVICE, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, TokenizerServicer("m"))
    await server.start()
    try:
        address = f"127.0.0.1:{server.port}"
        assert not await check_health(address)
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await Stub(channel).Tokenize(tokenizer_pb2.TokenizeRequest(text="x"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.drain_and_stop()


async def _max_loop_lag(until: asyncio.Future[object], period: float = 0.002) -> tuple[float, int]:
    """The longest delay of a `period` sleep beyond `period` while `until` runs, and the
    number of ticks. The servers of these tests run on the test's event loop, so a handler
    that blocks the loop shows up here as one lag as long as the block."""
    loop = asyncio.get_running_loop()
    worst, ticks = 0.0, 0
    while not until.done():
        start = loop.time()
        await asyncio.sleep(period)
        worst, ticks = max(worst, loop.time() - start - period), ticks + 1
    return worst, ticks


async def test_event_loop_stays_responsive(stub: Stub) -> None:
    long_chat = json.dumps([{"role": "user", "content": "word " * 100_000}])
    started = time.perf_counter()
    render = asyncio.ensure_future(stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages_json=long_chat)))
    # A cheap call completes while the big render runs in a worker thread.
    info = await asyncio.wait_for(stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest()), 5)
    lag, ticks = await _max_loop_lag(render)
    elapsed = time.perf_counter() - started
    assert info.vocab_size > 0
    assert len((await render).prompt_token_ids) >= 100_000
    # Rendering on the loop would freeze it for nearly all of `elapsed` (~0.5 s here);
    # in a thread the loop only waits for GIL switches (5 ms each) and the message copies.
    assert ticks >= 5, (ticks, elapsed)
    assert lag < max(0.1, elapsed / 3), f"event loop blocked {lag:.3f} s of a {elapsed:.3f} s render"


def test_process_entry_point(tiny_model_dir: Path) -> None:
    env = {**os.environ, "MESHSERVE_MODEL_DIR": str(tiny_model_dir), "MESHSERVE_PORT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenizer_svc", "--served-model-name", "tiny"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("tokenizer listening on 127.0.0.1:"), line
        address = line.split()[-1]
        assert asyncio.run(check_health(address, SERVICE, timeout=5))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_concurrent_calls(stub: Stub, renderer: Renderer, tiny_model_dir: Path) -> None:
    chat = tokenizer_pb2.RenderChatRequest(messages_json=json.dumps(MESSAGES))
    text = "Concurrent 你好 🎉 " * 100
    fetches = [_files(stub) for _ in range(20)]
    renders = [stub.RenderChat(chat) for _ in range(20)]
    tokenizes = [
        stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, return_token_strs=True)) for _ in range(20)
    ]
    results = await asyncio.gather(*fetches, *renders, *tokenizes)
    expected_files = {path.name: path.read_bytes() for path in tokenizer_files(tiny_model_dir)}
    for files in results[:20]:
        assert files == expected_files
    expected = renderer.render_chat(MESSAGES).prompt_token_ids
    for reply in results[20:40]:
        assert list(reply.prompt_token_ids) == expected
    ids, strs = renderer.tokenize(text, False, True)
    for reply in results[40:]:
        assert list(reply.token_ids) == ids and list(reply.token_strs) == strs
        assert reply.max_model_len == renderer.max_model_len


async def _files(stub: Stub) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    async for chunk in stub.GetTokenizer(tokenizer_pb2.GetTokenizerRequest()):
        files[chunk.name] = files.get(chunk.name, b"") + chunk.data
    return files
