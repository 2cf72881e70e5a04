"""`python -m scheduler_svc [--port PORT --redis-url redis://... --routing-policy prefix]`."""

from __future__ import annotations

import sys

from meshserve.v1 import scheduler_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.servicer import SchedulerServicer
from services.config import load_config
from services.log import setup_logging
from services.server import GrpcServer, run_service


async def main(config: SchedulerConfig) -> None:
    log = setup_logging("scheduler", config.log_level)
    scheduler = Scheduler(config)
    server = GrpcServer("scheduler", config)
    servicer = SchedulerServicer(scheduler)
    server.add_service("meshserve.v1.Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)
    server.on_drain(servicer.on_drain)
    await scheduler.start()
    await server.start()
    await server.set_serving(True)
    log.info("scheduler ready: policy %s, redis %s", config.routing_policy, config.redis_url or "off")
    try:
        await server.run_until_signal()
    finally:
        await scheduler.stop()


if __name__ == "__main__":
    parsed = load_config(SchedulerConfig, sys.argv[1:], prog="python -m scheduler_svc")
    run_service(lambda: main(parsed), parsed)
