"""services.worker_roles: the role names every service uses come from worker.proto's
WorkerRole, and the worker CLI still takes them as lowercase words."""

from __future__ import annotations

import pytest

from meshserve.v1 import scheduler_pb2, worker_pb2
from scheduler_svc.servicer import spec_from_proto
from services.config import load_config
from services.worker_roles import ROLES, role_name, role_value
from worker_svc.config import WorkerConfig


def test_roles_are_the_enum_values_named_in_lowercase() -> None:
    assert ROLES == ("decoder", "prefill", "embedding", "encoder")
    for name in ROLES:
        value = role_value(name)
        assert worker_pb2.WorkerRole.Name(value) == "WORKER_ROLE_" + name.upper()
        assert role_name(value) == name
    with pytest.raises(ValueError, match="role must be one of decoder, prefill, embedding, encoder"):
        role_value("wizard")
    # Neither UNSPECIFIED nor a number the enum lacks passes for a role.
    assert role_name(worker_pb2.WORKER_ROLE_UNSPECIFIED) not in ROLES
    assert role_name(99) == "99"


def test_the_worker_cli_takes_role_names() -> None:
    for name in ROLES:
        extra = ["--encoder-cache-address", "127.0.0.1:1"] if name == "encoder" else []
        config = load_config(WorkerConfig, ["--model-dir", "/m", "--role", name, *extra])
        assert config.role == name
    with pytest.raises(SystemExit):
        load_config(WorkerConfig, ["--model-dir", "/m", "--role", "wizard"])


def test_the_scheduler_reads_the_enum_into_role_names() -> None:
    def role_of(role: int) -> str:
        descriptor = scheduler_pb2.WorkerDescriptor(worker_id="w", address="a:1", role=role, model="m")
        return spec_from_proto(descriptor).role

    assert role_of(worker_pb2.WORKER_ROLE_PREFILL) == "prefill"
    assert role_of(worker_pb2.WORKER_ROLE_UNSPECIFIED) == "decoder"  # a descriptor without a role
    unknown = scheduler_pb2.WorkerDescriptor(worker_id="w", address="a:1", role=7, model="m")
    with pytest.raises(ValueError, match=r"worker\.role must be one of"):
        spec_from_proto(unknown).validate()
