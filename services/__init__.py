"""Shared runtime of every meshserve service: config, gRPC bootstrap, health, drain,
errors, logging, metrics, tracing and the Redis client. Never domain logic."""
