"""Transport security: TLS, mutual TLS, certificate reload (file change and SIGHUP), the plaintext rule,
and the ssl helpers offered to data lanes. Certificates are made per test (tests/certs.py)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kvstore.client import Client
from kvstore.config import ServeConfig
from kvstore.free_port import free_port
from kvstore.server.app import StoreServer
from kvstore.server.tls import InsecureTransport, client_ssl_context, is_loopback, server_ssl_context
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.certs import TlsFiles, make_tls_files

ROOT = Path(__file__).resolve().parent.parent


def call(
    port: int, ca: Path | None, cert: Path | None = None, key: Path | None = None, token: str | None = None
) -> grpc.StatusCode:
    """One Lookup over a fresh connection (never a pooled one); its status code."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    target = f"127.0.0.1:{port}"
    if ca is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        creds = grpc.ssl_channel_credentials(
            ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
        )
        channel = grpc.secure_channel(target, creds, options=options)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        pb_grpc.KVStoreStub(channel).Lookup(
            pb.LookupRequest(namespace="ns", hashes=[b"k" * 16]), timeout=5, metadata=metadata
        )
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()


@pytest.fixture
def pki(tmp_path) -> tuple[TlsFiles, TlsFiles]:
    return make_tls_files(tmp_path / "pki", "a"), make_tls_files(tmp_path / "pki", "b")


def test_tls(make_server, pki):
    a, b = pki
    server = make_server(tls_cert=str(a.server_cert), tls_key=str(a.server_key))
    assert call(server.port, a.ca) == grpc.StatusCode.OK
    assert call(server.port, None) == grpc.StatusCode.UNAVAILABLE  # plaintext client
    assert call(server.port, b.ca) == grpc.StatusCode.UNAVAILABLE  # does not trust the server
    with Client(f"127.0.0.1:{server.port}", tls_ca=str(a.ca)) as kv:
        kv.put("ns", [b"t" * 16], [b"over tls" * 100])
        assert kv.get("ns", [b"t" * 16]) == [b"over tls" * 100]


def test_mutual_tls(make_server, pki):
    a, b = pki
    server = make_server(tls_cert=str(a.server_cert), tls_key=str(a.server_key), tls_client_ca=str(a.ca))
    assert call(server.port, a.ca, a.client_cert, a.client_key) == grpc.StatusCode.OK
    assert call(server.port, a.ca) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert call(server.port, a.ca, b.client_cert, b.client_key) == grpc.StatusCode.UNAVAILABLE  # other CA
    with Client(
        f"127.0.0.1:{server.port}", tls_ca=str(a.ca), tls_cert=str(a.client_cert), tls_key=str(a.client_key)
    ) as kv:
        assert kv.lookup("ns", [b"m" * 16]) == 0


def _install(src: TlsFiles, cert: Path, key: Path) -> None:
    """Atomically replace the served pair (as a secret-mounting agent would)."""
    for source, dest in ((src.server_cert, cert), (src.server_key, key)):
        tmp = dest.with_suffix(".tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, dest)


def test_certificate_reloads_when_the_files_change(make_server, pki, tmp_path):
    a, b = pki
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    _install(a, cert, key)
    server = make_server(tls_cert=str(cert), tls_key=str(key))
    assert call(server.port, a.ca) == grpc.StatusCode.OK
    key.write_text("not a key")  # a broken intermediate state: the server keeps its current pair
    server.tls.request_reload()
    assert call(server.port, a.ca) == grpc.StatusCode.OK
    _install(b, cert, key)
    deadline = time.monotonic() + 10
    while call(server.port, b.ca) != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "new certificate never served"
        time.sleep(0.3)
    assert call(server.port, a.ca) == grpc.StatusCode.UNAVAILABLE
    assert server.tls.reloads == 1


def _rewrite_in_place(src: Path, dest: Path) -> None:
    """New PEM content with the same size, inode and mtime: only a SIGHUP reveals the change."""
    st = dest.stat()
    data = src.read_bytes()
    assert len(data) <= st.st_size + 64
    data = data + b"\n" * (st.st_size - len(data)) if len(data) <= st.st_size else data
    with open(dest, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sighup_reloads_certificate_and_tenants(pki, tmp_path):
    a, b = pki
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    for src, dest in ((a.server_cert, cert), (a.server_key, key)):
        dest.write_bytes(src.read_bytes() + b"\n" * 64)  # room to rewrite in place with any new pair
    tenants = tmp_path / "tenants.yaml"
    old, new = "first-tenant-token-0000000", "second-tenant-token-000000"
    tenants.write_text(yaml.safe_dump([{"name": "t", "token": old, "namespaces": ["ns"]}]))
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--metrics-port",
            "0",
            "--dram",
            "64MiB",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--tenants",
            str(tenants),
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while call(port, a.ca, token=old) != grpc.StatusCode.OK:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        _rewrite_in_place(b.server_cert, cert)
        _rewrite_in_place(b.server_key, key)
        tenants.write_text(yaml.safe_dump([{"name": "t", "token": new, "namespaces": ["ns"]}]))
        time.sleep(1.5)  # past the change check interval: the unchanged signatures hide the new pair
        assert call(port, a.ca, token=old) == grpc.StatusCode.OK
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while call(port, b.ca, token=new) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.2)
        assert call(port, b.ca, token=old) == grpc.StatusCode.UNAUTHENTICATED
        assert call(port, a.ca, token=new) == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert old not in err and new not in err


# -- the plaintext rule -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "listen, loopback",
    [
        ("127.0.0.1:7070", True),
        ("127.9.9.9:1", True),
        ("[::1]:7070", True),
        ("localhost:7070", True),
        ("0.0.0.0:7070", False),
        ("[::]:7070", False),
        (":7070", False),
        ("10.1.2.3:7070", False),
        ("store.example:7070", False),
    ],
)
def test_loopback_addresses(listen, loopback):
    assert is_loopback(listen) is loopback


def test_plaintext_beyond_loopback_needs_explicit_consent(make_server, caplog):
    with pytest.raises(InsecureTransport, match="--insecure-plaintext"):
        StoreServer(ServeConfig(listen="0.0.0.0:0", dram=8 << 20, metrics_port=0))
    caplog.set_level(logging.WARNING)
    server = make_server(listen="0.0.0.0:0", insecure_plaintext=True)
    assert call(server.port, None) == grpc.StatusCode.OK
    assert any("plaintext gRPC on 0.0.0.0:0" in r.getMessage() for r in caplog.records)
    caplog.clear()
    make_server(listen="127.0.0.1:0")
    assert not any("plaintext" in r.getMessage() for r in caplog.records)


def test_cli_refuses_plaintext_on_all_interfaces():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--listen",
            f"0.0.0.0:{free_port('0.0.0.0')}",
            "--metrics-port",
            "0",
            "--dram",
            "8MiB",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "refusing to serve plaintext" in run.stderr


def test_unusable_certificate_files_stop_the_start(pki, tmp_path):
    a, b = pki
    with pytest.raises(ValueError, match="do not load"):  # key of another certificate
        StoreServer(
            ServeConfig(
                listen="127.0.0.1:0",
                dram=8 << 20,
                metrics_port=0,
                tls_cert=str(a.server_cert),
                tls_key=str(b.server_key),
            )
        ).start()
    with pytest.raises(FileNotFoundError):
        StoreServer(
            ServeConfig(
                listen="127.0.0.1:0",
                dram=8 << 20,
                metrics_port=0,
                tls_cert=str(tmp_path / "nope"),
                tls_key=str(a.server_key),
            )
        ).start()


# -- ssl helpers for lanes --------------------------------------------------------------------------
def test_ssl_contexts_for_lanes(pki):
    a, b = pki
    cfg = ServeConfig(tls_cert=str(a.server_cert), tls_key=str(a.server_key), tls_client_ca=str(a.ca))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server_ctx = server_ssl_context(cfg)

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(tls.recv(100).upper())
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    good = client_ssl_context(str(a.ca), str(a.client_cert), str(a.client_key))
    with good.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as tls:
        tls.sendall(b"lane bytes")
        assert tls.recv(100) == b"LANE BYTES"
    stranger = client_ssl_context(str(a.ca), str(b.client_cert), str(b.client_key))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with stranger.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as tls:
            tls.sendall(b"x")
            if not tls.recv(100):
                raise ConnectionError("closed by the server")
    thread.join(5)
    listener.close()


def test_client_certificates_name_tenants(make_server, tmp_path):
    from tests.certs import issue, make_ca

    ca = make_ca("kvstore tenants CA")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    server_cert, server_key = issue(ca, "kvstore server", server=True).write(tmp_path, "server")
    worker_cert, worker_key = issue(ca, "team-a-worker", server=False).write(tmp_path, "worker")
    other_cert, other_key = issue(ca, "someone else", server=False).write(tmp_path, "other")
    token_b = "team-b token, long enough"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"""
tenants:
  - name: team-a
    cert_names: [team-a-worker]
    namespaces: [ns]
  - name: team-b
    token: "{token_b}"
    namespaces: [other]
""")
    ca_path = tmp_path / "ca.crt"
    with pytest.raises(ValueError, match="tls-client-ca"):  # certificates name nobody without mutual TLS
        make_server(tls_cert=str(server_cert), tls_key=str(server_key), tenants=str(tenants))
    server = make_server(
        tls_cert=str(server_cert), tls_key=str(server_key), tls_client_ca=str(ca_path), tenants=str(tenants)
    )
    assert call(server.port, ca_path, worker_cert, worker_key) == grpc.StatusCode.OK
    assert call(server.port, ca_path, other_cert, other_key) == grpc.StatusCode.UNAUTHENTICATED
    # a token names the caller whatever its certificate: team-b may not read "ns"
    assert call(server.port, ca_path, other_cert, other_key, token=token_b) == grpc.StatusCode.PERMISSION_DENIED
    assert call(server.port, ca_path, worker_cert, worker_key, token=token_b) == grpc.StatusCode.PERMISSION_DENIED
    assert call(server.port, ca_path, worker_cert, worker_key, token="x" * 20) == grpc.StatusCode.UNAUTHENTICATED
    with Client(
        f"127.0.0.1:{server.port}", tls_ca=str(ca_path), tls_cert=str(worker_cert), tls_key=str(worker_key)
    ) as kv:
        kv.put("ns", [b"c" * 16], [b"by certificate" * 10])
        assert bytes(kv.get("ns", [b"c" * 16])[0]) == b"by certificate" * 10
        with pytest.raises(Exception) as err:
            kv.lookup("other", [b"c" * 16])
        assert getattr(err.value, "code", None) == grpc.StatusCode.PERMISSION_DENIED
    assert server.metrics.counters()["unauthenticated"] >= 2
