"""The pieces between the tokenizer and the engine: image preprocessing (the model's image
processor and the PIL/NumPy fallback agree), the tokenizer's multimodal items, the
encoder (vision tower + projector only, equal to transformers' image features) and the
decoder's embedding fetch from the encoder cache."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoder_cache_svc.config import EncoderCacheConfig
from encoder_cache_svc.servicer import EncoderCacheServicer, RedisMetadata
from encoder_cache_svc.store import EncoderCacheStore
from meshserve.v1 import common_pb2, encoder_cache_pb2_grpc
from services.encoder_cache_client import CachedTensor, EmbeddingsMissing, EncoderCacheClient, cache_key
from services.errors import Code, InvalidArgument
from services.image_preprocess import ImagePreprocessor
from services.server import GrpcServer
from tests.multimodal.conftest import ReferenceBuilder, chat_messages, png_bytes
from tokenizer_svc.renderer import Renderer
from worker_svc.encoder import EncodeInput, VisionEncoder, tensor_bytes, tensor_from_bytes
from worker_svc.mm_fetch import EmbeddingFetcher


def _rgb(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


@pytest.mark.parametrize("size", [(40, 30), (30, 40), (7, 90), (32, 32), (3, 3)])
def test_builtin_preprocessing_equals_the_image_processor(vlm_dir: Path, size: tuple[int, int]) -> None:
    image = _rgb(png_bytes(sum(size), *size))
    hf = ImagePreprocessor.from_model_dir(vlm_dir)
    builtin = ImagePreprocessor.from_model_dir(vlm_dir, use_transformers=False)
    assert hf is not None and builtin is not None and builtin.backend == "builtin"
    a = hf(image.tobytes(), image.width, image.height)
    b = builtin(image.tobytes(), image.width, image.height)
    assert a.shape == b.shape == (3, 32, 32) and a.dtype == b.dtype == np.float32
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_tokenizer_items_carry_pixel_values(vlm_dir: Path, refs: ReferenceBuilder) -> None:
    png = png_bytes(21)
    result = Renderer.load(vlm_dir).render_chat(chat_messages(png))
    ref = refs.reference(png)
    assert result.prompt_token_ids == ref.prompt
    (item,) = result.mm_items
    assert (item.offset, item.length) == (ref.image_offset, refs.seq_length)
    assert item.dtype == "float32" and item.shape == (3, 32, 32)
    pixels = np.frombuffer(item.data, dtype=np.float32).reshape(item.shape)
    np.testing.assert_array_equal(pixels, ref.pixel_values[0].numpy())


@pytest.fixture(scope="module")
def encoder(vlm_dir: Path) -> VisionEncoder:
    return VisionEncoder(str(vlm_dir))


def test_encoder_loads_only_vision_weights_and_matches_transformers(
    encoder: VisionEncoder, refs: ReferenceBuilder
) -> None:
    text_params = sum(p.numel() for p in encoder.model.model.language_model.parameters())
    text_params += sum(p.numel() for p in encoder.model.lm_head.parameters())
    assert text_params < 1000  # a zero-layer, one-token stub; the checkpoint's text weights are not read
    pngs = [png_bytes(31), png_bytes(32, 50, 20)]
    refs_ = [refs.reference(png) for png in pngs]
    pixel_items = [
        EncodeInput(f"p{i}", refs.seq_length, "float32", (3, 32, 32), r.pixel_values[0].numpy().tobytes())
        for i, r in enumerate(refs_)
    ]
    raw_items = []
    for i, png in enumerate(pngs):
        image = _rgb(png)
        raw_items.append(
            EncodeInput(f"r{i}", refs.seq_length, "uint8", (image.height, image.width, 3), image.tobytes())
        )
    for items in (pixel_items, raw_items):
        for got, ref in zip(encoder.encode(items), refs_, strict=True):
            torch.testing.assert_close(got, refs.embeddings(ref), atol=1e-5, rtol=1e-5)


def test_encoder_rejects_bad_items(encoder: VisionEncoder) -> None:
    with pytest.raises(ValueError, match="placeholder tokens"):
        encoder.encode(
            [EncodeInput("x", 5, "float32", (3, 32, 32), np.zeros((3, 32, 32), np.float32).tobytes())]
        )
    with pytest.raises(ValueError, match="expected float pixel values"):
        encoder.encode([EncodeInput("y", 16, "int32", (3, 32, 32), b"\x00" * 4 * 3 * 32 * 32)])


def test_tensor_bytes_roundtrip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensor = torch.randn(5, 7).to(dtype)
        name, shape, data = tensor_bytes(tensor)
        assert torch.equal(tensor_from_bytes(name, shape, data), tensor)


@pytest.fixture
async def cache_client() -> AsyncIterator[EncoderCacheClient]:
    config = EncoderCacheConfig(port=0, capacity_mb=1)
    server = GrpcServer("encoder-cache-test", config)
    servicer = EncoderCacheServicer(EncoderCacheStore(1 << 20), RedisMetadata("", "t", ""), 1000)
    server.add_service(
        "meshserve.v1.EncoderCache", encoder_cache_pb2_grpc.add_EncoderCacheServicer_to_server, servicer
    )
    port = await server.start()
    client = EncoderCacheClient(f"127.0.0.1:{port}", chunk_bytes=1000)
    yield client
    await client.close()
    await server.server.stop(0)


async def test_decoder_fetches_embeddings_by_identifier(cache_client: EncoderCacheClient) -> None:
    embeddings = torch.randn(16, 64)
    dtype, shape, data = tensor_bytes(embeddings)  # 4 KB: several 1000-byte chunks
    await cache_client.put(CachedTensor(cache_key("vlm", "img-1"), dtype, shape, data))
    fetcher = EmbeddingFetcher(cache_client, "vlm", 64)
    item = common_pb2.MultiModalItem(identifier="img-1", offset=3, length=16)
    (got,) = await fetcher.fetch([item])
    assert (got.identifier, got.offset, got.length) == ("img-1", 3, 16)
    assert torch.equal(got.embeddings, embeddings)
    other_model = EmbeddingFetcher(cache_client, "other", 64)
    with pytest.raises(EmbeddingsMissing) as missing:
        await other_model.fetch([item])  # embeddings are per model
    assert missing.value.code is Code.FAILED_PRECONDITION
    with pytest.raises(InvalidArgument, match="shape"):
        await fetcher.fetch([common_pb2.MultiModalItem(identifier="img-1", offset=0, length=8)])


async def test_decoder_hands_embeddings_over_in_the_caches_dtype(cache_client: EncoderCacheClient) -> None:
    """No cast on the event loop's thread: the engine casts on its own (merge_mm_rows)."""
    embeddings = torch.randn(16, 64).to(torch.bfloat16)
    await cache_client.put(CachedTensor(cache_key("vlm", "img-bf16"), *tensor_bytes(embeddings)))
    fetcher = EmbeddingFetcher(cache_client, "vlm", 64)
    (got,) = await fetcher.fetch([common_pb2.MultiModalItem(identifier="img-bf16", offset=0, length=16)])
    assert got.embeddings.dtype == torch.bfloat16
    assert torch.equal(got.embeddings, embeddings)
