"""Fixtures of the tokenizer service tests: the tiny model's renderer, a variant model
directory that accepts images, and a real gRPC server on an ephemeral port."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from PIL import Image

from meshserve.v1 import tokenizer_pb2_grpc
from services.server import GrpcServer
from tests.mesh import IMAGE_SEQ_LENGTH, build_vlm_model
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.renderer import Renderer, RenderOptions
from tokenizer_svc.server import start_server
from tokenizer_svc.servicer import TokenizerServicer

PngFactory = Callable[..., str]


def _png_data_url(
    size: tuple[int, int] = (3, 2), color: tuple[int, ...] = (200, 10, 30), mode: str = "RGB"
) -> str:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="session")
def png_data_url() -> PngFactory:
    """Makes a small solid-colour PNG data URL: `png_data_url(size, color, mode)`."""
    return _png_data_url


@pytest.fixture(scope="session")
def image_seq_length() -> int:
    """Placeholder tokens per image of the `vlm_model_dir` model."""
    return IMAGE_SEQ_LENGTH


@pytest.fixture(scope="session")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.load(tiny_model_dir)


@pytest.fixture(scope="session")
def permissive_renderer(tiny_model_dir: Path) -> Renderer:
    """Same tokenizer, but request-supplied chat templates are allowed."""
    return Renderer.load(tiny_model_dir, RenderOptions(allow_request_chat_template=True))


@pytest.fixture(scope="session")
def vlm_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model plus an `<image>` special token and llava-style config keys."""
    return build_vlm_model(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture(scope="session")
def vlm_renderer(vlm_model_dir: Path) -> Renderer:
    return Renderer.load(vlm_model_dir)


@pytest.fixture(scope="session")
async def tokenizer_server(tiny_model_dir: Path) -> AsyncIterator[tuple[GrpcServer, TokenizerServicer]]:
    config = TokenizerConfig(host="127.0.0.1", port=0, model_dir=str(tiny_model_dir), drain_timeout_s=1.0)
    server, servicer = await start_server(config)
    yield server, servicer
    await server.drain_and_stop()


@pytest.fixture(scope="session")
def address(tokenizer_server: tuple[GrpcServer, TokenizerServicer]) -> str:
    return f"127.0.0.1:{tokenizer_server[0].port}"


@pytest.fixture(scope="session")
async def stub(address: str) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)
