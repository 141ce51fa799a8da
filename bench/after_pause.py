"""What a pause costs the next step on this host: CPU-bound work runs slower after the cores sat idle.

    python -m bench.after_pause [--quick] [--pauses 0,5,50] [--reps N] [--dir /var/tmp] [--out FILE.json]

Every other bench here takes its steps one after another with waits between them (a driver's pipe, another
process's step, a raw read), so a figure depends on how long the cores idled before it. This measures that
alone. Each step moves 16 MiB and is timed in series of ``--reps / 2`` steps of one kind, each step after the
same pause (``--pauses`` ms; 0: back to back, the cores kept busy), after 30 ms of the step run untimed; every
series twice, in turn with the others. A paused step so meets what a bench's step meets: the pause, and before it
one step of its kind. (How long the cores were busy before a pause matters too: a TCP Get of 16 MiB after 50 ms
took 3.5 ms when 30 ms of Gets came before the pause, 7.8 when one did.) The steps:

- ``memcpy``: one ``numpy.copyto`` between two 16 MiB buffers (the CPU and memory alone);
- ``socket``: 16 MiB over loopback TCP from another process, after a one-byte request (the kernel's copies and
  the two processes' wake-ups, no kvstore code: the baseline of the lane rows);
- ``disk``: one O_DIRECT ``preadv`` of a 16 MiB extent of a file in ``--dir`` (a DMA the CPU only waits on: the
  baseline every ``*_vs_raw`` ratio of ``bench.nvme_get`` divides by);
- ``shm_get``, ``tcp_get``: a DRAM-hit Get of 32 x 512 KiB through one ``kvstore serve`` on each lane, into
  page-aligned buffers; ``tcp_get_64k``: 32 x 64 KiB (2 MiB) on the TCP lane.

Rows: a step's p50 ms after each pause (``p50_ms_<P>``) and its slowdown over no pause (``slowdown_<P>``). A step
whose slowdown the ``disk`` row does not share loses that much of its ``Get / raw`` ratio in a bench that pauses
between steps, whatever its code does (docs/nvme_log.md, sixtieth session).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from tqdm import tqdm

from bench.common import parse_args, positive, report

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12
    from typing_extensions import Buffer

BYTES = 16 << 20
PREFIX = 32  # blocks a Get
EXTENTS = 8  # of the disk's file, read in turn
WARM_SECONDS = 0.03  # of the same step, untimed, before a series
ROUNDS = 2  # every series taken this many times, in turn with the others (the host drifts)


def _sender(port_q: Any) -> None:
    """The socket step's peer: BYTES of distinct memory for every byte it is sent, until the connection ends."""
    payload = memoryview(os.urandom(BYTES))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1):
                conn.sendall(payload)


def _socket_step(conn: socket.socket, buf: memoryview) -> None:
    conn.sendall(b"g")
    got = 0
    while got < BYTES:
        n = conn.recv_into(buf[got:], BYTES - got, socket.MSG_WAITALL)
        if n == 0:
            raise RuntimeError("the socket step's sender went away")
        got += n


def _disk_step(fd: int, buf: memoryview, i: int) -> None:
    os.preadv(fd, [buf], (i % EXTENTS) * BYTES)


def _get_step(kv: Any, prefixes: list[list[bytes]], out: list[np.ndarray]) -> Callable[[int], None]:
    def get(i: int) -> None:
        kv.get("bench", prefixes[i % len(prefixes)], out=out)

    return get


def measure(pauses: list[float], reps: int, root: Path, bar: tqdm) -> list[dict[str, Any]]:
    from kvstore.client import Client
    from kvstore.server.process import store_process
    from kvstore.tiers.nvme.io import aligned_buffer

    series = max(1, reps // ROUNDS)
    src, dst = np.ones(BYTES, np.uint8), np.zeros(BYTES, np.uint8)
    disk_buf = aligned_buffer(BYTES)
    disk_buf[:] = 7
    disk_view = memoryview(cast("Buffer", disk_buf))
    path = root / "extents"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    sender = ctx.Process(target=_sender, args=(port_q,), daemon=True)
    sender.start()
    try:
        for e in range(EXTENTS):
            os.pwrite(fd, disk_view, e * BYTES)
        conn = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock_buf = memoryview(bytearray(BYTES))
        with (
            store_process("--dram", "512MiB") as (target, _),
            Client(target, lane="shm") as shm,
            Client(target, lane="tcp") as tcp,
            conn,
        ):
            rng = np.random.default_rng(0)
            steps: dict[str, Callable[[int], None]] = {
                "memcpy": lambda i: np.copyto(dst, src),
                "socket": lambda i: _socket_step(conn, sock_buf),
                "disk": lambda i: _disk_step(fd, disk_view, i),
            }
            for name, kv, block in (
                ("shm_get", shm, 512 << 10),
                ("tcp_get", tcp, 512 << 10),
                ("tcp_get_64k", tcp, 64 << 10),
            ):
                kv.warm_up()
                blocks = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(PREFIX)]
                prefixes = []
                for _ in range(4):
                    keys = [rng.bytes(16) for _ in range(PREFIX)]
                    if not all(r.ok for r in kv.put("bench", keys, blocks)):
                        raise RuntimeError("the store refused a Put")
                    prefixes.append(keys)
                pool = aligned_buffer(PREFIX * block)
                pool[:] = 1  # faulted in before any Get
                out = [pool[k * block : (k + 1) * block] for k in range(PREFIX)]
                kv.get("bench", prefixes[0], out=out)
                if not all((o == b).all() for o, b in zip(out, blocks)):
                    raise RuntimeError(f"{name}: a Get came back different")
                steps[name] = _get_step(kv, prefixes, out)
            times: dict[tuple[str, float], list[float]] = {(s, p): [] for s in steps for p in pauses}
            for _ in range(ROUNDS):
                for pause in pauses:
                    for name, step in steps.items():
                        busy_until = time.perf_counter() + WARM_SECONDS  # the series starts from busy cores
                        while time.perf_counter() < busy_until:
                            step(0)
                        for i in range(series):
                            if pause:
                                time.sleep(pause / 1e3)
                            t0 = time.perf_counter()
                            step(i + 1)
                            times[name, pause].append(time.perf_counter() - t0)
                    bar.update(1)
    finally:
        os.close(fd)
        sender.terminate()
        sender.join(10)
    rows: list[dict[str, Any]] = []
    for name in steps:
        row: dict[str, Any] = {"step": name, "bytes": 2 << 20 if name == "tcp_get_64k" else BYTES}
        base = statistics.median(times[name, pauses[0]])
        for pause in pauses:
            p50 = statistics.median(times[name, pause])
            row[f"p50_ms_{pause:g}"] = p50 * 1e3
            if pause != pauses[0]:
                row[f"slowdown_{pause:g}"] = p50 / base
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--pauses",
            default="0,5,50",
            metavar="MS,...",
            help="the idle times before a step, in ms, the first the one the others are compared with (default 0,5,50)",
        )
        p.add_argument(
            "--reps", type=positive(int), default=None, help="steps of each kind after each pause (default 40)"
        )
        p.add_argument(
            "--dir", type=Path, default=Path("/var/tmp"), help="where the disk step's file goes (a disk, not tmpfs)"
        )

    args = parse_args("how much slower a step runs after the cores idled", argv, configure)
    try:
        pauses = [float(p) for p in args.pauses.split(",") if p]
    except ValueError:
        raise SystemExit(f"--pauses: not a list of numbers: {args.pauses!r}") from None
    if not pauses or any(p < 0 for p in pauses):
        raise SystemExit("--pauses: one or more pauses in ms, none below 0")
    reps = args.reps or (8 if args.quick else 40)
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvstore-after-pause-", dir=args.dir))
    try:
        with tqdm(total=ROUNDS * len(pauses), desc="after a pause", unit="series") as bar:
            rows = measure(pauses, reps, root, bar)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(
        rows, args, title="16 MiB steps after a pause, p50 ms and slowdown over the first pause", bench="after_pause"
    )


if __name__ == "__main__":
    main()
