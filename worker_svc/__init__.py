"""Decoder worker service: the gRPC front (worker_svc.server) over the engine package."""
