"""The TCP lane's compiled send of NVMe blocks (``kvstore.send_runs``) against the Python path it replaced, one run.

    python -m bench.compiled_send [--quick] [--sizes 64KiB,512KiB,2MiB] [--prefixes N] [--dir /var/tmp] [--out F]

Two ``kvstore serve`` processes, alike but for ``KVSTORE_COMPILED_SEND`` (``0``: the tier's threads read and the
lane's Python sends, as before the compiled send), each with DRAM for three prefixes over a write-through NVMe tier
that it reads itself (``--share-nvme false``). Each holds ``--prefixes`` 32-block prefixes only on NVMe. Each round
takes one prefix's TCP Get from each store, in turn, the order alternating, each followed by a raw O_DIRECT read of
as many bytes (the disk's speed just then). Nothing else runs beside them, unlike ``bench.nvme_get``'s every kind,
whose other stores' after-reply work lands on each step.

Rows, per block size: each way's Get p50 ms and its median Get / raw, how much faster the compiled Get is
(``speedup``: the Python p50 over the compiled), each store's CPU per Get (ms, from /proc), and the bytes the
compiled store's counter says it sent compiled (``lane_tcp_compiled_get_bytes``: 0 would mean it never ran).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from tqdm import tqdm

from bench.common import parse_args, positive, report
from bench.nvme_get_worker import cpu_seconds, write_prefix
from bench.nvme_raw import PREFIX
from kvstore import send_runs
from kvstore.client import Client
from kvstore.server.process import store_process
from kvstore.sizes import parse_size
from kvstore.tiers.nvme.io import aligned_buffer

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12
    from typing_extensions import Buffer

WAYS = {"python": {"KVSTORE_COMPILED_SEND": "0"}, "compiled": {}}
HEADER = 4096  # a record's header page before its payload, as the tier lays a prefix down


def measure(block: int, prefixes: int, root: Path, bar: Any) -> dict[str, Any]:
    """One block size: both stores' Gets of ``prefixes`` NVMe-only prefixes in turn with raw reads; its row."""
    rng = np.random.default_rng(block)
    dram = max(32 << 20, 3 * PREFIX * block)
    flush = dram // (PREFIX * block) + 2  # prefixes written after the read ones: those leave DRAM
    with contextlib.ExitStack() as stack:
        stores: dict[str, tuple[Client, int]] = {}
        for way, env in WAYS.items():
            target, proc = stack.enter_context(
                store_process(
                    *("--dram", f"{dram >> 20}MiB", "--nvme-dir", str(root / way), "--nvme", "16GiB"),
                    *("--write-policy", "write-through", "--share-nvme", "false"),
                    env=env,
                )
            )
            kv = stack.enter_context(Client(target, lane="tcp", timeout=120))
            kv.warm_up()
            stores[way] = (kv, proc.pid)
        payloads = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(8)]
        keys = {
            way: [write_prefix(kv, payloads, p, rng) for p in range(prefixes + flush)]
            for way, (kv, _) in stores.items()
        }
        time.sleep(1.0)  # the stores' demotions settle
        out_pool = aligned_buffer(PREFIX * block)
        out_pool[:] = 1  # faulted in before any Get
        out = [out_pool[k * block : (k + 1) * block] for k in range(PREFIX)]
        extent = PREFIX * (HEADER + block)
        raw_buffer = aligned_buffer(extent)
        raw_buffer[:] = 5
        raw = memoryview(cast("Buffer", raw_buffer))
        fd = os.open(root / "raw", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            for j in range(2 * prefixes):  # an extent for every raw read: none is read twice
                os.pwrite(fd, raw, j * extent)
            gets: dict[str, list[float]] = {way: [] for way in WAYS}
            ratios: dict[str, list[float]] = {way: [] for way in WAYS}
            cpu = {way: cpu_seconds(pid) for way, (_, pid) in stores.items()}
            reads = 0
            for i in range(prefixes):
                for way in list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]:
                    kv = stores[way][0]
                    t0 = time.perf_counter()
                    kv.get("bench", keys[way][i], out=out)
                    got = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    os.preadv(fd, [raw], reads * extent)
                    reads += 1
                    gets[way].append(got)
                    ratios[way].append((time.perf_counter() - t0) / got)
                bar.update(1)
            time.sleep(0.5)  # each store's work after its last reply
            cpu = {way: (cpu_seconds(pid) - cpu[way]) / prefixes for way, (_, pid) in stores.items()}
            compiled_bytes = stores["compiled"][0].stats()["counters"].get("lane_tcp_compiled_get_bytes", 0)
        finally:
            os.close(fd)
    row: dict[str, Any] = {"block_bytes": block, "prefixes": prefixes}
    for way in WAYS:
        row[f"{way}_p50_ms"] = statistics.median(gets[way]) * 1e3
        row[f"{way}_vs_raw"] = statistics.median(ratios[way])
        row[f"{way}_cpu_ms"] = cpu[way] * 1e3
    row["speedup"] = row["python_p50_ms"] / row["compiled_p50_ms"]
    row["compiled_bytes"] = int(compiled_bytes)
    return row


def main(argv: list[str] | None = None) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--sizes",
            default="64KiB,512KiB,2MiB",
            metavar="SIZE,...",
            help="block sizes, whole 4 KiB pages (default 64KiB,512KiB,2MiB)",
        )
        p.add_argument("--prefixes", type=positive(int), default=None, help="Gets of each store a size (default 40)")
        p.add_argument(
            "--dir", type=Path, default=Path("/var/tmp"), help="where the stores' NVMe tiers go (a disk, not tmpfs)"
        )

    args = parse_args("the TCP lane's compiled send of NVMe blocks against its Python path", argv, configure)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as err:
        raise SystemExit(f"--sizes: {err}") from None
    if not sizes or any(s <= 0 or s % HEADER for s in sizes):
        raise SystemExit("--sizes: one or more block sizes, each a whole number of 4 KiB pages")
    if not send_runs.COMPILED.available:
        raise SystemExit("the compiled send does not run here (it needs numba, SSE4.2 and PCLMULQDQ, Linux on x86-64)")
    prefixes = args.prefixes or (4 if args.quick else 40)
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tqdm(total=len(sizes) * prefixes, desc="compiled send", unit="round") as bar:
        for size in sizes:
            root = Path(tempfile.mkdtemp(prefix="kvstore-compiled-send-", dir=args.dir))
            try:
                rows.append(measure(size, prefixes, root, bar))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    report(
        rows,
        args,
        title="TCP Gets of 32-block prefixes only on NVMe, compiled send against the Python path, each with raw reads",
        bench="compiled_send",
    )


if __name__ == "__main__":
    main()
