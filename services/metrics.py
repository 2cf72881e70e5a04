"""Prometheus metrics shared by all services (each service process exposes its own
`/metrics` port). Metric names are documented in docs/metrics.md."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

RPC_REQUESTS = Counter(
    "meshserve_rpc_requests_total",
    "gRPC calls served, by method and final status code",
    ["method", "code"],
)
RPC_LATENCY = Histogram(
    "meshserve_rpc_duration_seconds",
    "gRPC call duration (whole stream for streaming calls)",
    ["method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)


def observe_rpc(method: str, code: str, seconds: float) -> None:
    RPC_REQUESTS.labels(method=method, code=code).inc()
    RPC_LATENCY.labels(method=method).observe(seconds)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics HTTP endpoint in a thread; returns the bound port (0 = off)."""
    if port < 0:
        return 0
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
