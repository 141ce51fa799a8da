"""SIGTERM drains without cutting replies: a slow reader still gets every byte, new calls are refused."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client
from kvstore.server.drain import port_unsent, wait_sent
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc


class SlowReaderProxy:
    """A loopback proxy whose store side has a small receive buffer and, once ``slow`` is set, is read slowly:
    the store's replies then wait in its socket's send queue, as they do for a client short of CPU."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.slow = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            store = socket.socket()
            store.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
            store.connect(self.upstream)
            threading.Thread(target=self._pipe, args=(client, store, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(store, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_store: bool) -> None:
        try:
            while data := src.recv(16384):
                dst.sendall(data)
                if from_store and self.slow.is_set():
                    time.sleep(0.001)
            dst.shutdown(socket.SHUT_WR)
        except ConnectionResetError:  # pass a reset on as a reset
            dst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            dst.close()
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()


def test_sigterm_drain_waits_for_a_slow_reader_and_refuses_new_calls(spawn_server):
    """Without the drain's wait, grpc closed the connection with replies still queued in the kernel and the
    client's next WINDOW_UPDATE made the kernel reset it: the stream ended "Stream removed" in each of 3 runs."""
    proc = spawn_server("--drain-seconds", "20")
    keys = [bytes([i]) * 16 for i in range(16)]
    payloads = [bytes([i]) * (1 << 20) for i in range(16)]
    with Client(proc.target) as kv:
        kv.put("ns", keys, payloads)
    proxy = SlowReaderProxy(("127.0.0.1", proc.port))
    slow = grpc.insecure_channel(proxy.target)
    direct = grpc.insecure_channel(proc.target)
    try:
        stream = pb_grpc.KVStoreStub(slow).Get(pb.GetRequest(namespace="ns", hashes=keys), timeout=30)
        got = [next(stream).data]
        proxy.slow.set()
        proc.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(direct)
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise AssertionError(f"SIGTERM did not start the drain; {proc.stacks()}")
            time.sleep(0.01)
        try:
            pb_grpc.KVStoreStub(direct).Lookup(pb.LookupRequest(namespace="ns", hashes=keys), timeout=5)
            raise AssertionError("a call made while the node drains was served")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (err.details() or "")
        got += [m.data for m in stream]
    finally:
        slow.close()
        direct.close()
        proxy.close()
    assert b"".join(got) == b"".join(payloads)
    assert proc.wait_exit(30) == 0


def test_port_unsent_counts_what_the_peer_has_not_taken():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    reader = socket.create_connection(("127.0.0.1", port))
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 10)
    writer, _ = listener.accept()
    writer.setblocking(False)
    sent = 0
    try:
        while True:
            sent += writer.send(b"x" * (64 << 10))
    except BlockingIOError:
        pass
    try:
        assert port_unsent(port) > 0
        assert wait_sent(lambda: port_unsent(port), time.monotonic() + 0.05) > 0  # nobody reads: still there
        received = 0
        while received < sent:
            received += len(reader.recv(1 << 20))
        assert wait_sent(lambda: port_unsent(port), time.monotonic() + 10) == 0
    finally:
        for s in (reader, writer, listener):
            s.close()
