"""A worker's load as worker.proto's `LoadStats` carries it, its fields named once (the
message's own): a worker fills one from its engine's stats, the scheduler reads it into
its snapshot of the worker and writes that back out for `ListWorkers`."""

from __future__ import annotations

from typing import Any

from meshserve.v1 import worker_pb2

__all__ = ["LOAD_FIELDS", "load_fields", "load_stats"]

# Every LoadStats field ("num_running", "kv_usage", ...), in the message's order.
LOAD_FIELDS: tuple[str, ...] = tuple(field.name for field in worker_pb2.LoadStats.DESCRIPTOR.fields)


def load_fields(load: object) -> dict[str, Any]:
    """Every `LoadStats` field of `load` (a `LoadStats`, or anything with an attribute of
    each name: the engine's stats, the scheduler's snapshot) by name."""
    return {name: getattr(load, name) for name in LOAD_FIELDS}


def load_stats(load: object) -> worker_pb2.LoadStats:
    """The `LoadStats` of `load` (see `load_fields`)."""
    return worker_pb2.LoadStats(**load_fields(load))
