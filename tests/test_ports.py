"""A port `kvstore serve` cannot bind stops it with one line naming the flag (exit 2, no traceback), before the
store starts; two stores with default flags on one host: the second says --metrics-port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvstore.config import ServeConfig
from kvstore.free_port import free_port
from kvstore.server.app import StoreServer
from kvstore.server.ports import Listener, PortError, probe
from tests.conftest import ROOT

DEFAULT_METRICS_PORT = ServeConfig().metrics_port


def serve(*flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--dram", "32MiB", *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def refused(*flags: str) -> tuple[int, list[str]]:
    proc = serve(*flags)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"kvstore serve {' '.join(flags)} kept running")
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port with a listener on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_default_metrics_port_is_not_prometheus():
    assert DEFAULT_METRICS_PORT not in (0, 9090)


def test_second_store_with_default_flags_names_metrics_port():
    try:
        probe(Listener("--metrics-port", "0.0.0.0", DEFAULT_METRICS_PORT))
    except PortError:
        pytest.skip(f"port {DEFAULT_METRICS_PORT} is already taken on this host (another store or program)")
    first = serve("--listen", f"127.0.0.1:{free_port()}")
    try:
        deadline = time.monotonic() + 60
        while not _listening(DEFAULT_METRICS_PORT):
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first store never bound its metrics port"
            time.sleep(0.2)
        code, lines = refused("--listen", f"127.0.0.1:{free_port()}")
    finally:
        first.terminate()
        first.communicate(timeout=30)
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvstore: --metrics-port {DEFAULT_METRICS_PORT}: ") and "in use" in lines[0]


@pytest.mark.parametrize("flag", ["--listen", "--tcp-lane-listen"])
def test_taken_address_is_one_line_naming_the_flag(taken, flag):
    flags = ["--metrics-port", "0", "--listen", f"127.0.0.1:{free_port()}"]
    flags += [flag, f"127.0.0.1:{taken}"]
    code, lines = refused(*flags)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvstore: {flag} 127.0.0.1:{taken}: cannot listen there")


def test_taken_metrics_port_is_one_line(taken):
    code, lines = refused("--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(taken))
    assert code == 2 and len(lines) == 1, lines
    assert f"--metrics-port {taken}" in lines[0] and "or 0 to turn metrics off" in lines[0]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--listen", "127.0.0.1:{p}", "--metrics-port", "{p}"], "--metrics-port {p}: cannot listen there (--listen"),
        (["--listen", "127.0.0.1:{p}", "--tcp-lane-listen", "127.0.0.1:{p}"], "--tcp-lane-listen 127.0.0.1:{p}: "),
    ],
)
def test_two_flags_on_one_port_are_named_together(flags, says):
    port = free_port()  # free: each flag's probe alone passes, and the second real bind used to fail on the first
    code, lines = refused(
        *(f.format(p=port) for f in flags), *([] if "--metrics-port" in flags else ["--metrics-port", "0"])
    )
    assert code == 2 and len(lines) == 1, lines
    assert says.format(p=port) in lines[0] and "asks for the same port" in lines[0], lines


# The real binds in StoreServer.start say the same when a port is taken after the preflight.
def test_start_names_the_metrics_port(taken):
    server = StoreServer(ServeConfig(listen="127.0.0.1:0", dram=16 << 20, metrics_port=taken))
    with pytest.raises(PortError, match=f"--metrics-port {taken}: "):
        server.start()
    server.stop(0)


def test_start_names_the_listen_address(taken):
    server = StoreServer(ServeConfig(listen=f"127.0.0.1:{taken}", dram=16 << 20, metrics_port=0))
    with pytest.raises(PortError, match=f"--listen 127.0.0.1:{taken}: "):
        server.start()
    server.stop(0)


def test_help_explains_the_default():
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "9090" in out and f"default: {DEFAULT_METRICS_PORT}" in out


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_shm_dir_too_long_for_the_lanes_socket_is_one_line_naming_it(tmp_path):
    """The shm lane's handshake socket lives in --shm-dir; a unix socket's path holds 107 bytes (it was reported
    as a taken --tcp-lane-listen port)."""
    from kvstore.lanes import cma

    if not cma.available():
        pytest.skip("no process_vm_readv here: the shm lane's socket is not made")
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    flags = ["--metrics-port", "0", "--log-level", "warning", "--listen", f"127.0.0.1:{free_port()}"]
    code, lines = refused(*flags, "--shm-dir", str(deep))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvstore: --shm-dir {deep}: too long for the shm lane's socket"), lines


def test_free_port_is_drawn_below_the_ephemeral_range():
    # an outgoing connection's local port cannot take it between the pick and the server's bind
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(20):
        port = free_port()
        assert port < ephemeral
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_ignores_the_shared_random_generator():
    # a test runner that seeds `random` alike in every worker must not make two workers draw the same ports
    import random

    random.seed(7)
    first = [free_port() for _ in range(5)]
    random.seed(7)
    assert [free_port() for _ in range(5)] != first
