"""TLS credentials for the gRPC server: TLS from cert/key files, mutual TLS with a client CA."""
from __future__ import annotations

from pathlib import Path

import grpc

from kvstore.config import ServeConfig


def server_credentials(cfg: ServeConfig) -> grpc.ServerCredentials:
    assert cfg.tls_cert and cfg.tls_key
    pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
