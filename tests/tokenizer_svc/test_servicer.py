"""The Tokenizer service over a real gRPC server on an ephemeral port, via generated stubs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.config import ServerConfig
from services.rpc import check_health
from services.server import GrpcServer
from tokenizer_svc.renderer import Renderer
from tokenizer_svc.servicer import SERVICE, TokenizerServicer

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


async def test_render_completion(stub: Stub, renderer: Renderer) -> None:
    reply = await stub.RenderCompletion(tokenizer_pb2.RenderCompletionRequest(text="Hello"))
    assert list(reply.prompt_token_ids) == renderer.encode("Hello", False)
    by_ids = tokenizer_pb2.RenderCompletionRequest(
        token_ids=tokenizer_pb2.TokenIds(ids=reply.prompt_token_ids)
    )
    assert (await stub.RenderCompletion(by_ids)).prompt_text == "Hello"


async def test_tokenize_detokenize_round_trip(stub: Stub) -> None:
    text = "Grüße, 世界! 🎉"
    tokens = await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text, return_token_strs=True))
    assert len(tokens.token_strs) == len(tokens.token_ids) > 0 and tokens.max_model_len == 2048
    reply = await stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=tokens.token_ids))
    assert reply.text == text


async def _detokenize_stream(
    stub: Stub, start: tokenizer_pb2.DetokenizeStart, chunks: Sequence[Sequence[int]]
) -> list[tokenizer_pb2.DetokenizeStreamResponse]:
    async def requests() -> AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest]:
        yield tokenizer_pb2.DetokenizeStreamRequest(start=start)
        for i, chunk in enumerate(chunks):
            yield tokenizer_pb2.DetokenizeStreamRequest(
                tokens=tokenizer_pb2.TokenIds(ids=chunk), finish=i == len(chunks) - 1
            )

    return [response async for response in stub.DetokenizeStream(requests())]


async def test_detokenize_stream_with_stop(stub: Stub, renderer: Renderer) -> None:
    ids = renderer.encode("Hi 🎉 there, the end is near. More text", False)
    chunks = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    start = tokenizer_pb2.DetokenizeStart(stop=["end is"], skip_special_tokens=True)
    replies = await _detokenize_stream(stub, start, chunks)
    assert "".join(r.text for r in replies) == "Hi 🎉 there, the "
    assert all("\ufffd" not in r.text for r in replies)
    last = replies[-1]
    assert last.stopped and last.matched_stop == "end is"
    assert all(not r.stopped for r in replies[:-1])
    assert "end is" in renderer.decode(ids[: last.num_tokens], True)
    assert len(replies) < len(chunks)  # the server ended the stream at the stop


async def test_detokenize_stream_flushes_on_finish(stub: Stub, renderer: Renderer) -> None:
    ids = renderer.encode("Hello 世界 🎉", False)[:-1]  # ends inside the emoji
    prompt = renderer.encode("<|im_start|>assistant\n", False)
    start = tokenizer_pb2.DetokenizeStart(prompt_token_ids=prompt, skip_special_tokens=True)
    replies = await _detokenize_stream(stub, start, [[i] for i in ids])
    assert len(replies) == len(ids)  # one reply per tokens message
    assert [r.num_tokens for r in replies] == list(range(1, len(ids) + 1))
    assert "".join(r.text for r in replies) == renderer.decode(ids, True)
    assert not any(r.stopped for r in replies)


async def test_detokenize_stream_half_close_flushes(stub: Stub, renderer: Renderer) -> None:
    ids = renderer.encode("abc", False)

    async def requests() -> AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest]:
        yield tokenizer_pb2.DetokenizeStreamRequest(start=tokenizer_pb2.DetokenizeStart(stop=["abcd"]))
        yield tokenizer_pb2.DetokenizeStreamRequest(tokens=tokenizer_pb2.TokenIds(ids=ids))

    replies = [r async for r in stub.DetokenizeStream(requests())]
    assert [r.text for r in replies] == ["", "abc"]  # held back as a possible stop, then flushed


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
    ids = tokenizer_pb2.RenderCompletionRequest(token_ids=tokenizer_pb2.TokenIds(ids=[-3]))
    await _expect_invalid(stub.RenderCompletion(ids), "prompt")


async def test_detokenize_stream_errors(stub: Stub) -> None:
    async def no_start() -> AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest]:
        yield tokenizer_pb2.DetokenizeStreamRequest(tokens=tokenizer_pb2.TokenIds(ids=[5]))

    async def bad_tokens() -> AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest]:
        yield tokenizer_pb2.DetokenizeStreamRequest(start=tokenizer_pb2.DetokenizeStart())
        yield tokenizer_pb2.DetokenizeStreamRequest(tokens=tokenizer_pb2.TokenIds(ids=[5, 10**6]))

    async def empty_stop() -> AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest]:
        yield tokenizer_pb2.DetokenizeStreamRequest(start=tokenizer_pb2.DetokenizeStart(stop=[""]))

    for requests, field in ((no_start, "start"), (bad_tokens, "tokens.ids"), (empty_stop, "stop[0]")):
        call = stub.DetokenizeStream(requests())
        await _expect_invalid(_drain(call), field)


async def _drain(call: AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]) -> None:
    async for _ in call:
        pass


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


async def test_event_loop_stays_responsive(stub: Stub) -> None:
    long_chat = json.dumps([{"role": "user", "content": "word " * 20000}])
    render = asyncio.ensure_future(stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages_json=long_chat)))
    # A cheap call completes while the big render runs in a worker thread.
    info = await asyncio.wait_for(stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest()), 5)
    assert info.vocab_size > 0
    assert len((await render).prompt_token_ids) >= 20000


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


async def test_concurrent_calls(stub: Stub, renderer: Renderer) -> None:
    ids = renderer.encode("Concurrent 你好 🎉 streams stop here please", False)
    start = tokenizer_pb2.DetokenizeStart(stop=["here"])
    chat = tokenizer_pb2.RenderChatRequest(messages_json=json.dumps(MESSAGES))
    streams = [_detokenize_stream(stub, start, [[i] for i in ids]) for _ in range(20)]
    renders = [stub.RenderChat(chat) for _ in range(20)]
    tokenizes = [stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="x " * 500)) for _ in range(20)]
    results = await asyncio.gather(*streams, *renders, *tokenizes)
    expected = renderer.render_chat(MESSAGES).prompt_token_ids
    for replies in results[:20]:
        assert "".join(r.text for r in replies) == "Concurrent 你好 🎉 streams stop "
    for reply in results[20:40]:
        assert list(reply.prompt_token_ids) == expected
