"""The worker roles, named once: the `WorkerRole` enum of worker.proto.

Services speak the enum on the wire and the lowercase name without its prefix
("decoder") everywhere else (CLI flags, config, metrics labels, logs); both come from
the enum's descriptor here, so a role added to the proto is known to every service.
"""

from __future__ import annotations

from typing import cast

from meshserve.v1 import worker_pb2

__all__ = ["ROLES", "role_name", "role_value"]

_PREFIX = "WORKER_ROLE_"

# Every role's name, in the enum's order ("decoder", "prefill", "embedding", "encoder").
ROLES: tuple[str, ...] = tuple(
    value.name.removeprefix(_PREFIX).lower()
    for value in worker_pb2.WorkerRole.DESCRIPTOR.values
    if value.number != worker_pb2.WORKER_ROLE_UNSPECIFIED
)


def role_name(value: int) -> str:
    """The name of a `WorkerRole` value ("decoder"); a value the enum lacks (or
    UNSPECIFIED) gives its number as text, which no check of a role against `ROLES` accepts."""
    if value == worker_pb2.WORKER_ROLE_UNSPECIFIED or value not in worker_pb2.WorkerRole.values():
        return str(value)
    return worker_pb2.WorkerRole.Name(value).removeprefix(_PREFIX).lower()


def role_value(name: str) -> worker_pb2.WorkerRole:
    """The `WorkerRole` of a role's name; ValueError naming the roles for any other name."""
    if name not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {name!r}")
    return cast(worker_pb2.WorkerRole, worker_pb2.WorkerRole.Value(_PREFIX + name.upper()))
