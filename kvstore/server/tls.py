"""Transport security of a store node: which transport, TLS credentials that reload, ssl helpers for lanes.

The rule (``transport(cfg)``), decided once at start:

- ``--tls-cert/--tls-key`` given: TLS; with ``--tls-client-ca`` also mutual
  TLS (clients must present a certificate signed by that CA).
- No certificate and a loopback listen address (127.0.0.0/8, ::1,
  localhost): plaintext. Only processes on this host can connect.
- No certificate and any other address: refused (``InsecureTransport``)
  unless ``--insecure-plaintext`` says the network is trusted; then plaintext
  with a warning in the log.

``bind(server, cfg)`` applies it. TLS credentials come from the files and
are re-read without a restart when they change (checked at most once a second,
on new connections) or on ``request_reload()`` (SIGHUP). A changed pair is used
only after it loads cleanly (key matches certificate); otherwise the node keeps
serving with the previous one and logs why. Existing connections keep the
certificate they were set up with.

For lanes that carry bytes over their own sockets: ``server_ssl_context(cfg)``
and ``client_ssl_context(ca, cert, key)`` build ``ssl.SSLContext`` objects from
the same files (TLS 1.2 or newer; client certificates required when the server
has a client CA).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore.config import ServeConfig

log = logging.getLogger(__name__)


class InsecureTransport(ValueError):
    """Plaintext on a non-loopback address without --insecure-plaintext."""


def is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost (or empty: all interfaces)


def transport(cfg: ServeConfig) -> str:
    """ "mtls", "tls" or "plaintext" for this config; InsecureTransport when plaintext is not allowed."""
    if cfg.tls_cert:
        return "mtls" if cfg.tls_client_ca else "tls"
    if is_loopback(cfg.listen) or cfg.insecure_plaintext:
        return "plaintext"
    raise InsecureTransport(
        f"refusing to serve plaintext gRPC on {cfg.listen}: anyone who can reach it could read and write blocks "
        f"and see tenant tokens. Give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), listen on "
        f"127.0.0.1, or pass --insecure-plaintext on a network you trust"
    )


def bind(server: grpc.Server, cfg: ServeConfig) -> tuple[int, CertReloader | None]:
    """Add the listening port under the transport rule; returns (port, reloader or None)."""
    mode = transport(cfg)
    if mode == "plaintext":
        if not is_loopback(cfg.listen):
            log.warning(
                "serving plaintext gRPC on %s (--insecure-plaintext): anyone who can reach it can read "
                "and write blocks and see tenant tokens",
                cfg.listen,
            )
        return server.add_insecure_port(cfg.listen), None
    assert cfg.tls_cert and cfg.tls_key  # not plaintext: a cert, and the config checked it comes with its key
    reloader = CertReloader(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    port = server.add_secure_port(cfg.listen, reloader.credentials())
    log.info("serving %s on %s", "mutual TLS" if mode == "mtls" else "TLS", cfg.listen)
    return port, reloader


Signature = tuple[tuple[int, int, int], ...]  # (mtime_ns, size, inode) per file


def _signature(paths: list[str]) -> Signature:
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


@dataclass(frozen=True)
class CertFiles:
    """The bytes of one certificate configuration, read together."""

    cert: bytes
    key: bytes
    client_ca: bytes | None


class CertReloader:
    """Serves the current certificate configuration to gRPC, re-reading the files when they change."""

    def __init__(self, cert: str, key: str, client_ca: str | None = None, check_interval_s: float = 1.0):
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._force = False
        self._checked_at = time.monotonic()
        self._signature = _signature(self._paths())
        self.current = self._load()  # errors here stop the node from starting: say so at once
        self._bad_signature: Signature | None = None
        self.reloads = 0

    def _paths(self) -> list[str]:
        return [p for p in (self.cert, self.key, self.client_ca) if p]

    def _load(self) -> CertFiles:
        files = CertFiles(
            Path(self.cert).read_bytes(),
            Path(self.key).read_bytes(),
            Path(self.client_ca).read_bytes() if self.client_ca else None,
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(self.client_ca)
        except ssl.SSLError as err:
            raise ValueError(
                f"TLS files {self.cert}, {self.key}{', ' + self.client_ca if self.client_ca else ''} do not load: {err}"
            ) from None
        again = CertFiles(
            Path(self.cert).read_bytes(),
            Path(self.key).read_bytes(),
            Path(self.client_ca).read_bytes() if self.client_ca else None,
        )
        if again != files:
            raise ValueError("TLS files changed while being read; will retry")
        return files

    @staticmethod
    def _configuration(files: CertFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files.key, files.cert)], root_certificates=files.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self.current),
            # grpc-stubs wants a fetcher that always returns a configuration; grpc documents None as "no change"
            self.fetch,  # type: ignore[arg-type]
            require_client_authentication=self.client_ca is not None,
        )

    def request_reload(self) -> None:
        """Re-read the files before the next handshake even if they look unchanged (SIGHUP)."""
        with self._lock:
            self._force = True

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC calls this before each new TLS handshake: a new configuration, or None for no change."""
        now = time.monotonic()
        with self._lock:
            if not self._force and now - self._checked_at < self.check_interval_s:
                return None
            self._checked_at = now
            force, self._force = self._force, False
            try:
                signature = _signature(self._paths())
            except OSError as err:
                log.error("TLS files unreadable, keeping the current certificate: %s", err)
                return None
            if not force and signature == self._signature:
                return None
            try:
                files = self._load()
            except (OSError, ValueError) as err:
                if signature != self._bad_signature:
                    log.error("new TLS files not used, keeping the current certificate: %s", err)
                    self._bad_signature = signature
                return None
            self._signature = signature
            if files == self.current:
                return None
            self.current = files
            self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert)
        return self._configuration(files)


def server_ssl_context(cfg: ServeConfig) -> ssl.SSLContext:
    """A server-side ssl context from the node's TLS files (client certificates required with a client CA)."""
    if not (cfg.tls_cert and cfg.tls_key):
        raise ValueError("server_ssl_context needs --tls-cert and --tls-key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    if cfg.tls_client_ca:
        ctx.load_verify_locations(cfg.tls_client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """A client-side ssl context: verifies the server against `ca` (system roots if None), with a client
    certificate for mutual TLS when `cert` and `key` are given. Host names are checked."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx
