"""Tokenizer service process: gRPC server, tokenizer loading, health, drain."""

from __future__ import annotations

import asyncio
import logging

from meshserve.v1 import tokenizer_pb2_grpc
from services.log import setup_logging
from services.server import GrpcServer
from tokenizer_svc.config import TokenizerConfig
from tokenizer_svc.multimodal import MediaPolicy
from tokenizer_svc.renderer import Renderer, RenderOptions
from tokenizer_svc.servicer import SERVICE, TokenizerServicer

log = logging.getLogger(__name__)


def render_options(config: TokenizerConfig) -> RenderOptions:
    """The renderer policy a service config asks for."""
    return RenderOptions(
        allow_request_chat_template=config.allow_request_chat_template,
        media=MediaPolicy(
            allowed_domains=config.allowed_media_domains,
            max_image_bytes=config.max_image_bytes,
            max_image_pixels=config.max_image_pixels,
            fetch_timeout_s=config.media_fetch_timeout_s,
        ),
        max_model_len=config.max_model_len,
    )


async def start_server(config: TokenizerConfig) -> tuple[GrpcServer, TokenizerServicer]:
    """Starts the gRPC server, loads the tokenizer (health NOT_SERVING meanwhile, calls get
    UNAVAILABLE), then reports SERVING. Returns the running server and its servicer."""
    server = GrpcServer("tokenizer", config)
    servicer = TokenizerServicer(config.served_model_name)
    server.add_service(SERVICE, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer)
    await server.start()
    renderer = await asyncio.to_thread(Renderer.load, config.model_dir, render_options(config))
    servicer.set_renderer(renderer)
    await server.set_serving(True)
    log.info(
        "serving %s from %s on %s:%d (vocab %d, max_model_len %d)",
        config.served_model_name,
        config.model_dir,
        config.host,
        server.port,
        renderer.vocab_size,
        renderer.max_model_len,
    )
    return server, servicer


async def main(config: TokenizerConfig) -> None:
    """Process entry point: `python -m tokenizer_svc --model-dir DIR [--port P ...]`."""
    setup_logging("tokenizer", config.log_level)
    server, _servicer = await start_server(config)
    print(f"tokenizer listening on {config.host}:{server.port}", flush=True)
    await server.run_until_signal()
