"""Optional mutual TLS between services: certificates made with openssl for 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.worker_streams import WorkerStreams
from meshserve.v1 import common_pb2
from services import tls
from services.config import ProcessConfig, ServerConfig, load_config
from services.rpc import check_health
from services.server import GrpcServer
from tests.gateway.test_worker_stream_transport import Sink
from tests.worker_svc.worker_kit import worker_process

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(name: str, d: Path) -> None:
    """A key and a certificate for 127.0.0.1 signed by the test CA."""
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=d,
    )
    (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-extfile",
        f"{name}.ext",
        cwd=d,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=meshserve-test-ca",
        cwd=d,
    )
    _issue("server", d)
    _issue("client", d)
    return d


@pytest.fixture
def client_env(certs: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MESHSERVE_TLS_CA", str(certs / "ca.pem"))
    monkeypatch.setenv("MESHSERVE_TLS_CERT", str(certs / "client.pem"))
    monkeypatch.setenv("MESHSERVE_TLS_KEY", str(certs / "client.key"))
    # What a process entry point does with its config (services.server.run_service).
    tls.use_client_files(tls.process_files(load_config(ProcessConfig, [])))
    yield
    tls.use_client_files(tls.TlsFiles())


def test_half_configured_tls_is_refused(certs: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        tls.TlsFiles(cert=str(certs / "server.pem"))
    with pytest.raises(ValueError, match="not found"):
        tls.TlsFiles(ca=str(certs / "missing.pem"))


async def test_mutual_tls_between_services(certs: Path, client_env: None) -> None:
    config = ServerConfig(
        port=0,
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        tls_ca=str(certs / "ca.pem"),
    )
    server = GrpcServer("tls-demo", config)
    port = await server.start()
    await server.set_serving(True)
    try:
        # A client with the CA and its own certificate (services.rpc.open_channel) gets through ...
        assert await check_health(f"127.0.0.1:{port}", timeout=5)
        # ... plaintext is refused ...
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)
        # ... and so is TLS without a client certificate (mutual TLS).
        anonymous = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", anonymous) as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    finally:
        await server.server.stop(0)


async def test_token_path_uses_mutual_tls(certs: Path, client_env: None, tiny_model_dir: Path) -> None:
    """A TLS worker's token path (the gateway's GenerateStream, client certificate from
    the env) gets output."""
    worker = worker_process(
        tiny_model_dir,
        worker_id="tls",
        kv_cache_memory_mb=8,
        tls_cert=str(certs / "server.pem"),
        tls_key=str(certs / "server.key"),
        tls_ca=str(certs / "ca.pem"),
    )
    await worker.start()
    streams = WorkerStreams(1 << 20)
    try:
        stream = streams.get("tls", f"127.0.0.1:{worker.server.port}")
        sink = Sink()
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        await stream.add(
            common_pb2.GenerateRequest(request_id="t", prompt_token_ids=[5, 6, 7], sampling=sampling), sink
        )
        async with asyncio.timeout(60):
            await sink.ended.wait()
        assert len(sink.tokens) == 5 and not sink.lost
    finally:
        await streams.close()
        await worker.server.server.stop(0)
        await worker.close()
