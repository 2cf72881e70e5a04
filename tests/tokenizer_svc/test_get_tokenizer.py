"""Tokenizer.GetTokenizer: the served model's tokenizer files, chunked and hashed, over a
real gRPC server; and the file reading underneath it."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from meshserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.config import ServerConfig
from services.server import GrpcServer
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.server import start_server
from tokenizer_svc.servicer import SERVICE, TokenizerServicer
from tokenizer_svc.tokenizer_files import CHUNK_BYTES, TOKENIZER_FILE_NAMES, read_chunks, tokenizer_files

Stub = tokenizer_pb2_grpc.TokenizerStub
MIB = 1024 * 1024


async def _chunks(stub: Stub, model: str = "") -> list[tokenizer_pb2.TokenizerFileChunk]:
    return [chunk async for chunk in stub.GetTokenizer(tokenizer_pb2.GetTokenizerRequest(model=model))]


def _check_framing(chunks: list[tokenizer_pb2.TokenizerFileChunk]) -> dict[str, bytes]:
    """Asserts the chunk protocol; returns the reassembled files."""
    files: dict[str, bytes] = {}
    current = ""
    for chunk in chunks:
        assert chunk.name and len(chunk.data) <= CHUNK_BYTES
        assert current in ("", chunk.name), "files must not interleave"
        assert chunk.name not in files or current == chunk.name, f"{chunk.name} sent twice"
        current = chunk.name
        files[chunk.name] = files.get(chunk.name, b"") + chunk.data
        if chunk.last:
            data = files[chunk.name]
            assert chunk.size == len(data)
            assert chunk.sha256 == hashlib.sha256(data).hexdigest()
            current = ""
        else:
            assert not chunk.sha256 and not chunk.size
    assert current == "", "the last file has no last chunk"
    return files


def test_read_chunks(tmp_path: Path) -> None:
    cases = {"empty": b"", "small": b"abc", "exact": b"x" * 8, "ragged": bytes(range(256)) * 5}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        chunks = list(read_chunks(path, chunk_bytes=8))
        assert b"".join(c.data for c in chunks) == data
        assert all(0 < len(c.data) <= 8 for c in chunks) or data == b""
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and chunks[-1].size == len(data)
        assert all(not c.sha256 and not c.size for c in chunks[:-1])
        assert {c.name for c in chunks} == {name}
    assert len(list(read_chunks(tmp_path / "exact", chunk_bytes=8))) == 1
    with pytest.raises(ValueError):
        list(read_chunks(tmp_path / "small", chunk_bytes=0))


def test_tokenizer_files_are_the_known_names_only(tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "build_info.json", "vocab.txt"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "merges.txt").mkdir()  # not a file
    assert [p.name for p in tokenizer_files(tmp_path)] == ["tokenizer.json", "vocab.txt", "config.json"]
    assert len(set(TOKENIZER_FILE_NAMES)) == len(TOKENIZER_FILE_NAMES)


async def test_round_trip_matches_the_model_dir(stub: Stub, tiny_model_dir: Path) -> None:
    files = _check_framing(await _chunks(stub))
    expected = tokenizer_files(tiny_model_dir)
    assert list(files) == [p.name for p in expected]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(files)
    for path in expected:
        assert hashlib.sha256(files[path.name]).hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    by_name = _check_framing(await _chunks(stub, model=tiny_model_dir.name))
    assert by_name == files


@pytest.fixture(scope="module")
def big_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tokenizer.json over 2 MiB (trailing JSON whitespace)."""
    out = tmp_path_factory.mktemp("models") / "tiny-big"
    shutil.copytree(tiny_model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    with (out / "tokenizer.json").open("ab") as file:
        file.write(b" " * (2 * MIB + 12345))
    return out


@pytest.fixture(scope="module")
async def big_stub(big_model_dir: Path) -> AsyncIterator[Stub]:
    config = TokenizerConfig(host="127.0.0.1", port=0, model_dir=str(big_model_dir), drain_timeout_s=1.0)
    server, _servicer = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Stub(channel)
    finally:
        await server.drain_and_stop()


async def test_large_file_is_sent_in_1_mib_chunks(big_stub: Stub, big_model_dir: Path) -> None:
    chunks = await _chunks(big_stub)
    files = _check_framing(chunks)
    sizes = [len(c.data) for c in chunks if c.name == "tokenizer.json"]
    assert sizes[:2] == [MIB, MIB] and len(sizes) == 3
    assert files["tokenizer.json"] == (big_model_dir / "tokenizer.json").read_bytes()


async def test_unknown_model_is_not_found(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _chunks(stub, model="gpt-17")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "gpt-17" in (info.value.details() or "")


async def test_unavailable_while_loading() -> None:
    server = GrpcServer("tokenizer-loading-files", ServerConfig(port=0, drain_timeout_s=0.5))
    server.add_service(SERVICE, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, TokenizerServicer("m"))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _chunks(Stub(channel))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.drain_and_stop()
