"""The least a Python store process can take to serve a Get from NVMe: the floor under issue 19's store-read lanes.

    python -m bench.nvme_floor [--quick] [--dir /var/tmp] [--piece 2MiB] [--read-threads 2] [--out FILE.json]
    python -m bench.nvme_get --floor true ...      (the same floor, step for step beside the real stores' Gets)

``bench.nvme_get`` finds the store-read lanes (the store reads a prefix from its NVMe tier and hands it to a
client) under the disk's speed on 2 cores, and the profiles find no one hot spot: it is the store's Python per
Get. This bench asks what is left when a store process does nothing but the data path. A *floor server* (this
module run with ``--serve``, a process of its own) holds a file of prefixes laid down as the NVMe tier lays them
(32 records of a 4 KiB header page and a block, ``record_bytes``), the CRC32C of every payload in an array (what
the store's index would hold), and two sockets. For each Get (one request: the prefix's number) it reads the
prefix in pieces of whole records (at most ``--piece`` each, ``--read-threads`` of them in flight; a prefix of
at most 4 MiB, as 32 x 64 KiB, is one piece, read by the serving thread itself: the settings that measured best), checks each piece's CRC32Cs as it lands and hands its
blocks on at once:

- ``floor_shm``: into the client's buffers with one ``process_vm_writev`` a piece
  (``kvstore.lanes.cma.write_many``, as the store-read shm lane with ``--shm-direct`` does), then a byte on a
  Unix socket;
- ``floor_tcp``: on a loopback TCP socket (``sendmsg`` of the piece's payloads), which the client reads into its
  buffers (as the TCP lane does, without its frames);
- ``floor_grpc``: as a server-streaming gRPC call of raw bytes (no protobuf), messages of at most 1 MiB (small
  blocks joined, large ones cut: one copy, as the store's hand-made Get messages), which the client copies into
  its buffers (Python's gRPC, with nothing of the store's around it).

No index, no lease, no promotion, no lane protocol: what a real store does beyond this is its own cost. ``raw``:
the client's own O_DIRECT ``preadv`` of another prefix-sized extent (as ``bench.nvme_get``'s baseline). The
steps are taken in turn, prefix by prefix in a rotating order, each extent read once (a repeated read could come
from the host's cache), and every step's extents are written interleaved (this virtual disk reads recently
written data faster).

Rows: p50 ms of each step, ``shm_floor_vs_raw``, ``tcp_floor_vs_raw`` and ``grpc_floor_vs_raw`` (raw time / Get
time, 1 = as fast as the bare disk: the most a store-read lane in Python could reach here),
``floor_server_cpu_ms``, the floor server's CPU per Get (user and system, every thread, gRPC's own included), and
``floor_shm_thread_cpu_ms`` (and ``_tcp_``, ``_grpc_``), a lane's serving thread's per Get of its own (the checks
and the hand-off, the kernel's copies in it included); beside the stores' in ``bench.nvme_get --floor true``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import numpy as np
from tqdm import tqdm

from bench.common import format_table, parse_args, positive, write_json
from kvstore import memops_jit
from kvstore.checksum import crc32c
from kvstore.hugepages import huge_buffer
from kvstore.lanes import cma
from kvstore.lanes.framing import recv_into, send_all
from kvstore.sizes import parse_size
from kvstore.tiers.nvme.format import HEADER_BYTES, record_bytes

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12 (collections.abc.Buffer's too)
    from typing_extensions import Buffer

PREFIX = 32
MiB = 1 << 20
# The floor is the least time: its reads as they measured best here (``--piece``, ``--read-threads``, two runs
# each, 2026-12-06): a 2.2 MB prefix (32 x 64 KiB) read whole on the serving thread, shm 0.62-0.72 of the raw read
# against 0.57-0.62 in two pieces; larger ones in 2 MiB pieces, 2 in flight: at 512 KiB 0.88-0.94 against
# 0.76-0.88 in 4 MiB pieces and 0.66-0.71 in 8 MiB ones; at 2 MiB every setting 0.88-0.95.
WHOLE_BYTES = 4 * MiB
REQUEST = struct.Struct("<I")  # the number of a prefix extent in the file
ADDRESS = struct.Struct("<QQ")  # the client's pool: address of its first block, stride between blocks
GETS = ("floor-shm", "floor-tcp", "floor-grpc")
MESSAGE_BYTES = 1 * MiB  # a gRPC message's payload at the most, as the store's Get messages
GRPC_SERVICE = "kvstore.floor.Floor"
GRPC_OPTIONS = [("grpc.max_send_message_length", 4 * MiB), ("grpc.max_receive_message_length", 4 * MiB)]
REPO = Path(__file__).resolve().parent.parent


class PrefixFile:
    """Prefix extents in one file, extent ``i`` at ``i * extent`` (``write(i, rng)``); every payload random, its
    CRC32C kept in ``crcs[i]``."""

    def __init__(self, path: Path, block: int, extents: int):
        self.path, self.block = path, block
        self.record = record_bytes(block)
        self.extent = PREFIX * self.record
        self.crcs = np.zeros((extents, PREFIX), dtype=np.uint32)
        self._buf: np.ndarray | None = None
        self._fd = -1

    def write(self, i: int, rng: np.random.Generator) -> None:
        if self._buf is None:
            self._buf = huge_buffer(self.extent)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        self._buf[:] = rng.integers(0, 256, self.extent, dtype=np.uint8)
        self.crcs[i] = [crc32c(view) for view in self.payloads(self._buf)]
        os.pwrite(self._fd, cast("Buffer", self._buf), i * self.extent)

    def written(self) -> None:
        """Every extent is written: on the device, the write buffer gone."""
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
        self._fd, self._buf = -1, None

    def payloads(self, buf: np.ndarray) -> list[np.ndarray]:
        at = [k * self.record + HEADER_BYTES for k in range(PREFIX)]
        return [buf[a : a + self.block] for a in at]


class FloorServer:
    """The server side (``--serve``): per Get, O_DIRECT reads, 32 CRC32Cs and the hand-offs, nothing else.

    A prefix is read whole when it is at most ``WHOLE_BYTES``, else in pieces of whole records of at most
    ``piece_bytes`` (one record where a record is larger), ``read_threads`` of them in flight; the serving thread
    checks and hands off each piece's blocks in order as it lands, so the checks and copies of one piece overlap
    the reads of the next (a prefix of one piece is read on the serving thread itself, no hand-off). The client
    asks one Get at a time, so the lanes' serving threads (shm, TCP, gRPC) share the staging buffer and the pool."""

    def __init__(self, file: PrefixFile, unix_path: str, piece_bytes: int, read_threads: int):
        self.file = file
        self.fd = os.open(file.path, os.O_RDONLY | os.O_DIRECT)
        self.staging = huge_buffer(file.extent)
        self.views = [memoryview(cast("Buffer", v)) for v in file.payloads(self.staging)]
        per = PREFIX if file.extent <= WHOLE_BYTES else max(1, piece_bytes // file.record)
        self.pieces = [range(s, min(s + per, PREFIX)) for s in range(0, PREFIX, per)]
        self.pool = ThreadPoolExecutor(read_threads, thread_name_prefix="floor-read")
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(unix_path)
        self.unix.listen(1)
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.thread_cpu = dict.fromkeys(GETS, 0.0)  # each lane's serving thread: its checks and hand-offs

    def _read(self, i: int, piece: range) -> None:
        start, n = piece.start * self.file.record, len(piece) * self.file.record
        got = os.preadv(self.fd, [cast("Buffer", self.staging[start : start + n])], i * self.file.extent + start)
        if got != n:
            raise OSError(f"short read of prefix {i}: {got} of {n} bytes at {start}")

    def checked(self, i: int) -> Iterator[range]:
        """Read prefix ``i``: each piece, in order, once its blocks match their CRC32Cs."""
        landed: list[Future[None] | None] = [None]
        if len(self.pieces) == 1:
            self._read(i, self.pieces[0])
        else:
            landed = [self.pool.submit(self._read, i, piece) for piece in self.pieces]
        for piece, read in zip(self.pieces, landed):
            if read is not None:
                read.result()
            for k in piece:
                if crc32c(self.views[k]) != int(self.file.crcs[i, k]):
                    raise ValueError(f"prefix {i} block {k}: CRC32C mismatch")
            yield piece

    def serve_shm(self, conn: socket.socket) -> None:
        with conn:  # a failed Get (a corrupt block) closes the connection: the client sees it, never waits
            pid = cma.peer_pid(conn)
            base, stride = ADDRESS.unpack(recv_exact(conn, ADDRESS.size))
            pairs = [(base + k * stride, view) for k, view in enumerate(self.views)]
            while request := recv_exact(conn, REQUEST.size, eof_ok=True):
                t0 = time.thread_time()
                for p in self.checked(REQUEST.unpack(request)[0]):
                    cma.write_many(pid, pairs[p.start : p.stop])
                self.thread_cpu["floor-shm"] += time.thread_time() - t0
                conn.sendall(b"\x01")

    def serve_tcp(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while request := recv_exact(conn, REQUEST.size, eof_ok=True):
                t0 = time.thread_time()
                for p in self.checked(REQUEST.unpack(request)[0]):
                    send_all(conn, self.views[p.start : p.stop])
                self.thread_cpu["floor-tcp"] += time.thread_time() - t0

    def grpc_get(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """A server-streaming Get of raw bytes: each checked piece's payloads as messages of at most
        ``MESSAGE_BYTES``, small blocks joined (one copy, as the store's packed Get messages), large ones cut."""
        t0 = time.thread_time()
        try:
            for p in self.checked(REQUEST.unpack(request)[0]):
                yield from messages(self.views[p.start : p.stop])
        finally:
            self.thread_cpu["floor-grpc"] += time.thread_time() - t0

    def start_grpc(self) -> tuple[grpc.Server, int]:
        server = grpc.server(ThreadPoolExecutor(1, thread_name_prefix="floor-grpc"), options=GRPC_OPTIONS)
        rpc = grpc.unary_stream_rpc_method_handler(self.grpc_get)  # no (de)serializers: bytes in, bytes out
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, {"Get": rpc}),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, port

    def run(self) -> None:
        """Serve one client on each socket (and gRPC) until it closes the sockets; then print the CPU the Gets took (seconds: the
        whole process's, each lane's serving thread's) as JSON."""
        grpc_server, grpc_port = self.start_grpc()
        print(self.tcp.getsockname()[1], grpc_port, flush=True)
        shm, _ = self.unix.accept()
        tcp, _ = self.tcp.accept()
        start = resource.getrusage(resource.RUSAGE_SELF)
        threads = [
            threading.Thread(target=self.serve_shm, args=(shm,)),
            threading.Thread(target=self.serve_tcp, args=(tcp,)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grpc_server.stop(None)
        end = resource.getrusage(resource.RUSAGE_SELF)
        total = end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime
        print(json.dumps({"total": total, **self.thread_cpu}), flush=True)


def messages(views: list[memoryview]) -> Iterator[bytes]:
    """The views' bytes in order, as messages of at most ``MESSAGE_BYTES``: runs of small views joined into one,
    a large view cut in pieces; each byte copied once."""
    run: list[memoryview] = []
    size = 0
    for view in views:
        if len(view) >= MESSAGE_BYTES:
            if run:
                yield b"".join(run)
                run, size = [], 0
            for at in range(0, len(view), MESSAGE_BYTES):
                yield bytes(view[at : at + MESSAGE_BYTES])
            continue
        if size + len(view) > MESSAGE_BYTES:
            yield b"".join(run)
            run, size = [], 0
        run.append(view)
        size += len(view)
    if run:
        yield b"".join(run)


def recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            if eof_ok and not data:
                return b""
            raise ConnectionError("the floor server's peer closed the connection")
        data += chunk
    return data


class Floor:
    """The client side: ``count`` prefixes for each of ``steps`` (the floor's Gets, and ``raw`` when asked) in one
    file, the floor server process and its two connections. ``write(i)`` writes the i-th prefix of every step;
    ``start()`` once all are written; ``take(step, i)`` times one step on the i-th prefix, its bytes checked."""

    def __init__(
        self,
        root: Path,
        block: int,
        count: int,
        rng: np.random.Generator,
        steps: tuple[str, ...] = GETS,
        piece_bytes: int = 2 * MiB,
        read_threads: int = 2,
    ):
        self.root, self.block, self.count, self.steps, self.rng = root, block, count, steps, rng
        self.piece_bytes, self.read_threads = piece_bytes, read_threads
        self.file = PrefixFile(root / f"floor-{block}.bin", block, len(steps) * count)
        self.server: subprocess.Popen[str] | None = None
        self.server_cpu_s: dict[str, float] = {}
        self._open = contextlib.ExitStack()  # what start() opened, closed by close() however far it got
        self._connected = False  # start() finished: the server serves, and exits once its clients go

    def _extent(self, step: str, i: int) -> int:
        return i * len(self.steps) + self.steps.index(step)

    def write(self, i: int) -> None:
        for step in self.steps:
            self.file.write(self._extent(step, i), self.rng)

    def start(self) -> None:
        self.file.written()
        crcs, unix_path = self.root / f"floor-crcs-{self.block}.npy", str(self.root / f"floor-{self.block}.sock")
        np.save(crcs, self.file.crcs)
        argv = [str(self.file.path), str(self.block), str(len(self.file.crcs)), str(crcs), unix_path]
        argv += [str(self.piece_bytes), str(self.read_threads)]
        self.server = subprocess.Popen(
            [sys.executable, "-m", "bench.nvme_floor", "--serve", *argv], stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        assert self.server.stdout is not None
        ports = self.server.stdout.readline().split()
        if len(ports) != 2:
            raise RuntimeError(f"the floor server did not start (exit status {self.server.poll()}; its error is above)")
        port, grpc_port = map(int, ports)
        if not cma.allow_reader(self.server.pid):
            raise RuntimeError("this process already lets another process write its memory (Yama)")
        self._open.callback(cma.forget_reader)
        self.pool = huge_buffer(PREFIX * self.block)  # the Gets' destination: 32 page-aligned blocks
        self.raw_buf = huge_buffer(self.file.extent)
        self.unix = self._open.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        self.unix.connect(unix_path)
        self.unix.sendall(ADDRESS.pack(self.pool.ctypes.data, self.block))
        self.tcp = self._open.enter_context(socket.create_connection(("127.0.0.1", port)))
        self.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for sock in (self.unix, self.tcp):
            sock.settimeout(60.0)  # a stuck server fails the bench, it does not hang it
        self.fd = os.open(self.file.path, os.O_RDONLY | os.O_DIRECT)
        self._open.callback(os.close, self.fd)
        self.channel = self._open.enter_context(grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=GRPC_OPTIONS))
        self.grpc_get = self.channel.unary_stream(f"/{GRPC_SERVICE}/Get", None, None)  # bytes in, bytes out
        self._connected = True

    def take(self, step: str, i: int) -> float:
        at = self._extent(step, i)
        t0 = time.perf_counter()
        if step == "raw":
            os.preadv(self.fd, [cast("Buffer", self.raw_buf)], at * self.file.extent)
            return time.perf_counter() - t0
        if step == "floor-shm":
            self.unix.sendall(REQUEST.pack(at))
            recv_exact(self.unix, 1)
        elif step == "floor-tcp":
            self.tcp.sendall(REQUEST.pack(at))
            recv_into(self.tcp, memoryview(cast("Buffer", self.pool)))
        else:  # each message copied into the pool where it belongs, as a client's Get into a caller's buffers
            view, filled = memoryview(cast("Buffer", self.pool)), 0
            for message in self.grpc_get(REQUEST.pack(at), timeout=60.0):
                view[filled : filled + len(message)] = message
                filled += len(message)
            if filled != len(view):
                raise AssertionError(f"floor-grpc: {filled} of {len(view)} bytes")
        seconds = time.perf_counter() - t0
        last = self.pool[(PREFIX - 1) * self.block :]  # what landed is what was written
        if crc32c(last) != int(self.file.crcs[at, PREFIX - 1]):
            raise AssertionError(f"{step}: prefix {i}'s last block landed wrong")
        return seconds

    def cpu_rows(self, gets_per_lane: int) -> dict[str, float]:
        """The server's CPU per Get: ``floor_server_cpu_ms`` (the process, over both lanes' Gets) and
        ``floor_shm_thread_cpu_ms`` and the like (a lane's serving thread per Get of its own)."""
        cpu = self.server_cpu_s
        rows = {"floor_server_cpu_ms": 1e3 * cpu.get("total", 0.0) / (len(GETS) * gets_per_lane)}
        for get in GETS:
            rows[f"{get.replace('-', '_')}_thread_cpu_ms"] = 1e3 * cpu.get(get, 0.0) / gets_per_lane
        return rows

    def close(self) -> None:
        """Stop the server; ``server_cpu_s`` is then what its Gets took: ``total`` (the process, every thread)
        and each lane's serving thread (its checks and hand-offs, the kernel's copies in them included)."""
        self._open.close()  # the server sees its clients gone, prints what its Gets took and exits
        if self.server is None:
            return
        if not self._connected:  # a start that failed halfway: the server still waits for a connection
            self.server.kill()
        try:
            lines = self.server.communicate(timeout=60)[0].split("\n")
        except subprocess.TimeoutExpired:
            self.server.kill()
            lines = self.server.communicate()[0].split("\n")
        cpu = [line for line in lines if line.startswith("{")]
        self.server_cpu_s = json.loads(cpu[-1]) if cpu else {}
        self.server = None


def measure(block: int, count: int, root: Path, bar: tqdm, piece_bytes: int, read_threads: int) -> dict[str, float]:
    rng = np.random.default_rng(block)
    steps = ("raw", *GETS)
    floor = Floor(root, block, count, rng, steps, piece_bytes, read_threads)
    times: dict[str, list[float]] = {s: [] for s in steps}
    try:
        for i in range(count):
            floor.write(i)
        floor.start()
        for r, i in enumerate(int(i) for i in rng.permutation(count)):
            k = r % len(steps)
            for step in steps[k:] + steps[:k]:
                times[step].append(floor.take(step, i))
            bar.update(1)
    finally:
        floor.close()
    p50 = {s: statistics.median(v) for s, v in times.items()}
    return {
        "block_bytes": block,
        "prefixes": count,
        "piece_bytes": piece_bytes,
        "read_threads": read_threads,
        "raw_p50_ms": 1e3 * p50["raw"],
        **{f"{get.replace('-', '_')}_p50_ms": 1e3 * p50[get] for get in GETS},
        **{f"{get.removeprefix('floor-')}_floor_vs_raw": p50["raw"] / p50[get] for get in GETS},
        "raw_extent_gbps": floor.file.extent / p50["raw"] / 1e9,
        **floor.cpu_rows(count),
    }


def serve(argv: list[str]) -> None:
    path, block, extents, crcs, unix_path, piece, threads = argv
    file = PrefixFile(Path(path), int(block), int(extents))
    file.crcs = np.load(crcs)
    memops_jit.warm_up()  # as a store's --warm-up: the CRC32C kernels compiled before the first Get
    FloorServer(file, unix_path, int(piece), int(threads)).run()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(argv[1:])
        return

    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dir",
            type=Path,
            default=Path("/var/tmp"),
            help="where the prefixes' file goes (a disk, not tmpfs); removed afterwards",
        )
        p.add_argument(
            "--piece",
            type=parse_size,
            default=2 * MiB,
            help="the floor server's reads: whole records, at most this much each, a prefix of at most 4 MiB whole (default 2MiB)",
        )
        p.add_argument(
            "--read-threads", type=positive(int), default=2, help="the floor server's reads in flight (default 2)"
        )

    args = parse_args("The least a Python store process takes to serve a Get of a prefix from NVMe", argv, configure)
    sizes = {64 << 10: 24, 512 << 10: 8, 2 << 20: 5} if args.quick else {64 << 10: 64, 512 << 10: 24, 2 << 20: 12}
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvstore-nvme-floor-", dir=args.dir))
    try:
        with tqdm(total=sum(sizes.values()), unit="prefix", desc="floor gets") as bar:
            rows = [measure(b, n, root, bar, args.piece, args.read_threads) for b, n in sizes.items()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        "Prefix Gets (32 blocks) from a floor server (O_DIRECT reads, CRC32Cs, hand-offs; nothing else), p50 ms, in turn with a raw read"
    )
    print(format_table(rows))
    if args.out:
        write_json(args.out, rows, args, bench="nvme_floor")
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
