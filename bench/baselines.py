"""Baselines measured in the same run as the thing they judge: memcpy, raw loopback TCP, Redis.

Each returns GB/s (1e9 bytes per second) for moving `blocks` (a list of
equal-size byte strings) the way the store would: as one batch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np


def memcpy_gbps(total_bytes: int, reps: int = 3) -> float:
    src = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    src = np.tile(src, max(1, total_bytes >> 20))
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, src.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def _sink(port_q: mp.Queue[int], total: int, reps: int, distinct: bool) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        # one 4 MiB buffer reused (stays in cache); distinct: a batch-sized destination, as a store's arena
        buf = memoryview(bytearray(total if distinct else 1 << 22))
        for _ in range(reps):
            left = total
            while left:
                at = total - left if distinct else 0
                left -= conn.recv_into(buf[at:], min(left, len(buf) - at))
            conn.sendall(b"k")
        conn.close()


def _source(port_q: mp.Queue[int], total: int, reps: int, distinct: bool) -> None:
    # one 16 MiB buffer sent again and again (stays in cache); distinct: the batch's bytes, as a store's slots
    payload = memoryview(os.urandom(total if distinct else min(total, 1 << 24)))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        for _ in range(reps):
            conn.recv(1)
            left = total
            while left:
                n = min(left, len(payload))
                conn.sendall(payload[:n])
                left -= n
        conn.close()


def raw_socket_gbps(total_bytes: int, direction: str, reps: int = 3, distinct: bool = False) -> float:
    """Loopback TCP between two processes: 'put' sends total_bytes, 'get' receives them.

    The sender repeats one buffer of at most 16 MiB and the put receiver reuses
    one 4 MiB buffer, so both stay in the CPU caches (the baseline of the
    issue's targets). ``distinct=True`` moves the bytes as a store does: from
    ``total_bytes`` of distinct memory into ``total_bytes`` of distinct memory
    (here 15-25% slower for 128 MiB batches).
    """
    ctx = mp.get_context("spawn")
    port_q: mp.Queue[int] = ctx.Queue()
    peer = ctx.Process(
        target=_sink if direction == "put" else _source, args=(port_q, total_bytes, reps, distinct), daemon=True
    )
    peer.start()
    port = port_q.get(timeout=30)
    times = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = memoryview(os.urandom(total_bytes if distinct else min(total_bytes, 1 << 24)))
        buf = memoryview(bytearray(total_bytes))
        for _ in range(reps):
            start = time.perf_counter()
            if direction == "put":
                left = total_bytes
                while left:
                    n = min(left, len(data))
                    conn.sendall(data[:n])
                    left -= n
                conn.recv(1)
            else:
                conn.sendall(b"g")
                got = 0
                while got < total_bytes:
                    got += conn.recv_into(buf[got:], total_bytes - got)
            times.append(time.perf_counter() - start)
    peer.join(10)
    return total_bytes / float(np.median(times)) / 1e9


@contextmanager
def redis_server() -> Iterator[int]:
    """A throwaway redis-server on a free loopback port (no persistence)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: apt-get install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvstore-redis-")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--protected-mode",
            "yes",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def redis_gbps(port: int, keys: Sequence[bytes], blocks: Sequence[bytes], reps: int = 3) -> tuple[float, float]:
    """Redis as a block store: pipelined SET then pipelined GET of the same blocks (put, get GB/s)."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    total = sum(len(b) for b in blocks)
    put_t, get_t = [], []
    for _ in range(reps):
        r.flushall()
        start = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k, b in zip(keys, blocks):
            pipe.set(k, b)
        pipe.execute()
        put_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got = pipe.execute()
        get_t.append(time.perf_counter() - start)
        assert len(got) == len(keys) and len(got[0]) == len(blocks[0])
    r.flushall()
    r.close()
    return total / float(np.median(put_t)) / 1e9, total / float(np.median(get_t)) / 1e9
