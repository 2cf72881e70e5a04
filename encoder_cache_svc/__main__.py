"""`python -m encoder_cache_svc [--port PORT --capacity-mb MIB --redis-url URL]`"""

from __future__ import annotations

import sys

from encoder_cache_svc.config import EncoderCacheConfig
from encoder_cache_svc.servicer import EncoderCacheServicer, RedisMetadata
from encoder_cache_svc.store import EncoderCacheStore
from meshserve.v1 import encoder_cache_pb2_grpc
from services.config import load_config
from services.log import setup_logging
from services.server import GrpcServer, run_service


async def main(config: EncoderCacheConfig) -> None:
    setup_logging("encoder-cache", config.log_level)
    server = GrpcServer("encoder-cache", config)
    store = EncoderCacheStore(config.capacity)
    servicer = EncoderCacheServicer(
        store, RedisMetadata(config.redis_url, config.shard_id, ""), config.chunk_bytes
    )
    server.add_service(
        "meshserve.v1.EncoderCache", encoder_cache_pb2_grpc.add_EncoderCacheServicer_to_server, servicer
    )
    port = await server.start()
    servicer.metadata = RedisMetadata(
        config.redis_url, config.shard_id, config.advertise_address or f"{config.host}:{port}"
    )
    await server.set_serving(True)
    await server.run_until_signal()


if __name__ == "__main__":
    parsed = load_config(EncoderCacheConfig, sys.argv[1:], prog="encoder_cache_svc")
    run_service(lambda: main(parsed), parsed)
