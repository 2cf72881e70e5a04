"""Every RPC of the `meshserve.v1` contracts has a caller in the product: an RPC only tests
or benchmarks call is a contract nobody relies on, and goes (docs/architecture.md)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import meshserve.v1

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "scheduler_svc", "worker_svc", "tokenizer_svc", "encoder_cache_svc", "services")


def _rpcs() -> list[tuple[str, str]]:
    """(service, method) of every RPC in the generated descriptors."""
    found = []
    for module in pkgutil.iter_modules(meshserve.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"meshserve.v1.{module.name}").DESCRIPTOR
            for service in descriptor.services_by_name.values():
                found.extend((service.name, method.name) for method in service.methods)
    return found


def _product_source() -> str:
    """The product's Python (generated stubs live outside these packages)."""
    files = [path for package in PRODUCT for path in sorted((ROOT / package).rglob("*.py"))]
    return "\n".join(path.read_text() for path in files)


def test_every_rpc_has_a_product_caller() -> None:
    source = _product_source()
    rpcs = _rpcs()
    assert len(rpcs) > 10, rpcs  # the descriptors were found
    # A stub call (`stub.Method(`, not a servicer calling its own handler) or the method
    # named for a generic call (`getattr(stub, "Method")`).
    uncalled = [
        f"{service}.{method}"
        for service, method in rpcs
        if not re.search(rf'(?<!self)\.{method}\(|"{method}"', source)
    ]
    assert not uncalled, f"RPCs no product code calls: {uncalled}"
