"""The gateway's in-process tokenizer: files fetched from a real tokenizer service over
loopback gRPC, verified and cached; the loaded tokenizer decodes exactly like the
service's own; corrupt or hostile streams are refused."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.local_tokenizer import (
    GatewayTokenizers,
    LocalTokenizer,
    TokenizerFilesError,
    fetch_tokenizer_files,
    files_key,
)
from meshserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.completion_prompt import completion_token_ids
from services.config import ServerConfig
from services.errors import Code, InvalidArgument, MeshError
from services.server import GrpcServer
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.renderer import Renderer
from tokenizer_svc.server import start_server
from tokenizer_svc.tokenizer_files import tokenizer_files

Stub = tokenizer_pb2_grpc.TokenizerStub
Chunk = tokenizer_pb2.TokenizerFileChunk
TIMEOUT = 30.0
TEXTS = [
    "Hello, world!",
    "Grüße, 世界! 🎉 naïve café — ∑ 👩‍💻",
    "<|im_start|>assistant\nDone.<|im_end|>",
    "  leading spaces and\nnew lines\t tabs",
]


@pytest.fixture(scope="module")
async def service(tiny_model_dir: Path) -> AsyncIterator[Stub]:
    """A real tokenizer service on the tiny model."""
    config = TokenizerConfig(host="127.0.0.1", port=0, model_dir=str(tiny_model_dir), drain_timeout_s=1.0)
    server, _servicer = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Stub(channel)
    finally:
        await server.drain_and_stop()


@pytest.fixture(scope="module")
def service_renderer(tiny_model_dir: Path) -> Renderer:
    """The tokenizer service's own renderer (its tokenizer loaded from the model dir)."""
    return Renderer.load(tiny_model_dir)


@pytest.fixture(scope="module")
async def fetched(service: Stub, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return await fetch_tokenizer_files(service, "", tmp_path_factory.mktemp("tok-cache"), TIMEOUT)


@pytest.fixture(scope="module")
def local(fetched: Path) -> LocalTokenizer:
    return LocalTokenizer.load(fetched)


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_fetch_round_trip(service: Stub, tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = await fetch_tokenizer_files(service, tiny_model_dir.name, tmp_path, TIMEOUT)
    expected = {p.name: _sha(p) for p in tokenizer_files(tiny_model_dir)}
    assert {p.name: _sha(p) for p in directory.iterdir()} == expected
    sizes = {p.name: p.stat().st_size for p in tokenizer_files(tiny_model_dir)}
    assert directory == tmp_path / files_key({n: (s, sizes[n]) for n, s in expected.items()})
    again = await fetch_tokenizer_files(service, "", tmp_path, TIMEOUT)
    assert again == directory
    assert _listing(tmp_path) == [directory.name], "temporary files left behind"


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    pieces = []
    for token_id in ids:
        step = detok.push([token_id])
        pieces.append(step.text)
        if step.stopped:
            break
    pieces.append(detok.finish())
    return pieces


async def test_local_tokenizer_decodes_like_the_service(
    local: LocalTokenizer, service: Stub, service_renderer: Renderer
) -> None:
    assert local.vocab_size == service_renderer.vocab_size
    assert local.eos_token_ids == service_renderer.eos_token_ids
    prompt = service_renderer.encode("<|im_start|>user\n你好<|im_end|>\n", False)
    for text in TEXTS:
        ids = service_renderer.encode(text, False)
        for skip in (True, False):
            remote = await service.Detokenize(
                tokenizer_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=skip)
            )
            assert local.decode(ids, skip) == remote.text == service_renderer.decode(ids, skip)
            for stop in ([], ["!"], ["é", "世界"]):
                mine = _stream(local.detokenizer(prompt, skip, stop, True), ids)
                theirs = _stream(
                    IncrementalDetokenizer(service_renderer.tokenizer, prompt, skip, stop, True), ids
                )
                assert mine == theirs, (text, skip, stop)
            assert "".join(_stream(local.detokenizer(prompt, skip), ids)) == remote.text


async def test_gateway_renders_completion_prompts_like_the_service(
    local: LocalTokenizer, service: Stub
) -> None:
    info = await service.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest())
    assert not info.HasField("image_token_id")  # a text-only model
    for text in [*TEXTS, "<s> literal special token text </s>", " "]:
        for special in (True, False):
            remote = await service.Tokenize(
                tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=special)
            )
            mine = completion_token_ids(local.tokenizer, info.vocab_size, None, text, None, special)
            assert mine == list(remote.token_ids), (text, special)
    with pytest.raises(InvalidArgument) as error:
        completion_token_ids(local.tokenizer, info.vocab_size, None, None, [1, info.vocab_size], True)
    assert error.value.param == "prompt"


def test_token_strings(local: LocalTokenizer, service_renderer: Renderer) -> None:
    ids = service_renderer.encode(TEXTS[1] + TEXTS[2], False)
    strings = local.token_strings(ids)
    assert strings == {i: service_renderer.tokenizer.decode([i], skip_special_tokens=False) for i in ids}
    assert any("\ufffd" in s for s in strings.values())  # bytes of one character, shown alone
    assert local.token_strings(iter([local.vocab_size, 10**9])) == {local.vocab_size: "", 10**9: ""}
    assert local.token_strings([]) == {}


def test_detokenizer_refuses_prompt_ids_outside_the_vocabulary(local: LocalTokenizer) -> None:
    with pytest.raises(InvalidArgument) as info:
        local.detokenizer([1, 2, local.vocab_size])
    assert info.value.param == "prompt_token_ids"
    local.detokenizer([local.vocab_size, 1, 2, 3, 4, 5])  # only the last few ids are used


async def test_tampered_cache_is_replaced(
    service: Stub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = await fetch_tokenizer_files(service, "", tmp_path, TIMEOUT)
    target = directory / "tokenizer.json"
    original = target.read_bytes()
    target.write_bytes(original.replace(b'"', b"'", 1))
    with caplog.at_level(logging.WARNING, logger="gateway.local_tokenizer"):
        again = await fetch_tokenizer_files(service, "", tmp_path, TIMEOUT)
    assert again == directory and target.read_bytes() == original
    assert "corrupt cached tokenizer" in caplog.text and "tokenizer.json" in caplog.text
    assert _listing(tmp_path) == [directory.name]


async def test_unknown_model_is_not_found(service: Stub, tmp_path: Path) -> None:
    with pytest.raises(MeshError) as info:
        await fetch_tokenizer_files(service, "gpt-17", tmp_path, TIMEOUT)
    assert info.value.code is Code.NOT_FOUND and "gpt-17" in info.value.message
    assert _listing(tmp_path) == []


# -- hostile or broken streams, from a fake service on a real server ---------------------


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Streams whatever chunks the test puts in `chunks`; counts GetTokenizer calls."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.calls = 0
        self.delay = 0.0

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Chunk]:
        self.calls += 1
        await asyncio.sleep(self.delay)
        for chunk in self.chunks:
            yield chunk


@pytest.fixture(scope="module")
async def fake() -> AsyncIterator[tuple[FakeTokenizer, Stub]]:
    servicer = FakeTokenizer()
    server = GrpcServer("fake-tokenizer", ServerConfig(port=0, drain_timeout_s=0.5))
    server.add_service("meshserve.v1.Tokenizer", tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield servicer, Stub(channel)
    finally:
        await server.drain_and_stop()


def _file(name: str, data: bytes, *, sha: str | None = None, size: int | None = None) -> list[Chunk]:
    """`data` as two chunks with a correct (or the given) sha256 and size."""
    half = len(data) // 2
    digest = hashlib.sha256(data).hexdigest() if sha is None else sha
    return [
        Chunk(name=name, data=data[:half]),
        Chunk(
            name=name, data=data[half:], last=True, sha256=digest, size=len(data) if size is None else size
        ),
    ]


GOOD = _file("tokenizer_config.json", b'{"model_max_length": 8}')
BAD_STREAMS = {
    "wrong-sha256": _file("tokenizer.json", b"{}", sha=hashlib.sha256(b"[]").hexdigest()),
    "wrong-size": _file("tokenizer.json", b"{}", size=3),
    "flipped-byte": [
        *_file("tokenizer.json", b"{}")[:1],
        Chunk(name="tokenizer.json", data=b"]", last=True, sha256=hashlib.sha256(b"{}").hexdigest(), size=2),
    ],
    "ends-inside-a-file": _file("tokenizer.json", b"{}")[:1],
    "interleaved": [*_file("a.json", b"{}")[:1], *_file("b.json", b"{}")],
    "sent-twice": [*_file("tokenizer.json", b"{}"), *_file("tokenizer.json", b"{}")],
    "no-files": [],
    "traversal": _file("../evil.json", b"{}"),
    "dot-dot": _file("..", b"{}"),
    "absolute": _file("/tmp/evil.json", b"{}"),
    "subdirectory": _file("sub/evil.json", b"{}"),
    "backslash": _file("..\\evil.json", b"{}"),
    "hidden": _file(".incoming-x", b"{}"),
    "empty-name": _file("", b"{}"),
}


@pytest.mark.parametrize("case", list(BAD_STREAMS))
async def test_bad_stream_is_refused(case: str, fake: tuple[FakeTokenizer, Stub], tmp_path: Path) -> None:
    servicer, stub = fake
    # A good file first: the bad part must be caught even after a good start.
    servicer.chunks = [*GOOD, *BAD_STREAMS[case]] if BAD_STREAMS[case] else []
    servicer.delay = 0.0
    cache = tmp_path / "cache"
    with pytest.raises(TokenizerFilesError):
        await fetch_tokenizer_files(stub, "m", cache, TIMEOUT)
    assert _listing(cache) == [], "nothing may stay in the cache"
    assert _listing(tmp_path) == ["cache"], "nothing may be written outside it"


# -- GatewayTokenizers ------------------------------------------------------------------------


async def test_registry_loads_once_and_caches(service: Stub, tmp_path: Path) -> None:
    calls = 0

    class CountingStub:
        def GetTokenizer(self, *args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return service.GetTokenizer(*args, **kwargs)

    registry = GatewayTokenizers(CountingStub(), tmp_path, TIMEOUT)  # type: ignore[arg-type]
    assert registry.cached("") is None
    first = await asyncio.gather(*(registry.get("") for _ in range(10)))
    assert all(t is first[0] for t in first) and calls == 1
    assert await registry.get("") is first[0] and registry.cached("") is first[0] and calls == 1
    assert first[0].decode(first[0].tokenizer.encode("héllo"), True) == "héllo"


async def test_registry_does_not_cache_failures(fake: tuple[FakeTokenizer, Stub], tmp_path: Path) -> None:
    servicer, stub = fake
    servicer.chunks, servicer.delay, servicer.calls = _file("tokenizer.json", b"{}", size=9), 0.0, 0
    registry = GatewayTokenizers(stub, tmp_path, TIMEOUT)
    for _ in range(2):
        with pytest.raises(TokenizerFilesError):
            await registry.get("m")
    assert servicer.calls == 2 and registry.cached("m") is None


async def test_registry_load_survives_a_cancelled_caller(service: Stub, tmp_path: Path) -> None:
    registry = GatewayTokenizers(service, tmp_path, TIMEOUT)
    leaving = asyncio.ensure_future(registry.get(""))
    staying = asyncio.ensure_future(registry.get(""))
    await asyncio.sleep(0)
    leaving.cancel()
    tokenizer = await staying
    assert registry.cached("") is tokenizer
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_not_found_through_the_registry(service: Stub, tmp_path: Path) -> None:
    registry = GatewayTokenizers(service, tmp_path, TIMEOUT)
    with pytest.raises(MeshError) as info:
        await registry.get("gpt-17")
    assert info.value.code is Code.NOT_FOUND
