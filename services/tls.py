"""Optional TLS (and mutual TLS) for gRPC between services.

Off by default. Every process reads the same three settings of its config
(`services.config.ProcessConfig`: flags or their environment variables); a server serves
with them, and `use_client_files` makes them what this process's clients present:

- MESHSERVE_TLS_CERT / MESHSERVE_TLS_KEY: this process's certificate chain and key
  (PEM). A server with both serves TLS only; a client presents them (mutual TLS).
- MESHSERVE_TLS_CA: CA bundle (PEM). Clients verify servers against it; a server
  that has it also requires and verifies client certificates (mutual TLS).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from services.config import ProcessConfig


@dataclass(frozen=True)
class TlsFiles:
    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls_cert and tls_key must be given together")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"tls_{name} file not found: {path}")


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None = plaintext); with a CA, client certs are required."""
    if not files.cert:
        return None
    pair = (Path(files.key).read_bytes(), Path(files.cert).read_bytes())
    ca = _read(files.ca)
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client (None = plaintext, when no CA is configured)."""
    if not files.ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca), private_key=_read(files.key), certificate_chain=_read(files.cert)
    )


def process_files(config: ProcessConfig) -> TlsFiles:
    """A process's TLS settings (its --tls-* flags / MESHSERVE_TLS_*)."""
    return TlsFiles(config.tls_cert, config.tls_key, config.tls_ca)


_client = TlsFiles()


def use_client_files(files: TlsFiles) -> None:
    """What this process's channels to other services present and verify from now on
    (process entry points set their config's; plaintext until then)."""
    global _client
    _client = files


def client_files() -> TlsFiles:
    """This process's client-side TLS settings (`use_client_files`)."""
    return _client
