"""What a decode worker sees for a prefix cached on NVMe: client Gets through a `kvstore serve` process.

    python -m bench.nvme_get [--quick] [--lane auto|shm|tcp|grpc] [--out bench/results/nvme_get.json]

One store process (write-through, so every block has an NVMe copy; DRAM
``--dram``), 32-block prefixes of 64 KiB, 512 KiB and 2 MiB blocks written to
it, then each prefix fetched once, in shuffled order, into page-aligned
buffers (``Client.get(out=...)``), three ways taken in turn prefix by prefix
so that all see the disk in the same state:

- ``nvme``: a Get of a prefix that NVMe holds, against a store whose DRAM
  holds three prefixes (at least 32 MiB): room to promote what a Get reads, as
  the store does by default, while most prefixes are only on NVMe
  (``nvme_hits`` and ``dram_hits`` count where blocks came from);
- ``raw``: one O_DIRECT ``preadv`` of a prefix-sized extent (32 x (4 KiB +
  block), as the tier lays a prefix down) of a file written beside the store's
  segments just before, each extent read once (the disk's speed at the same
  amount of data, the baseline);
- ``dram``: the same Get against a second store whose DRAM holds everything
  and has no NVMe tier (what the lane and the server cost without the disk).

Rows: ``get_nvme_p50_ms``, ``get_dram_p50_ms``, ``raw_extent_p50_ms``,
``nvme_vs_raw`` (raw time / Get time, 1 = as fast as the bare disk) and GB/s of
payload. Only this machine's disk is measured; a real NVMe drive changes the
``raw`` column, not what the store adds on top of it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import format_table, parse_args, write_json
from kvstore.client import Client
from kvstore.server.process import store_process
from kvstore.tiers.nvme.format import record_bytes
from kvstore.tiers.nvme.io import aligned_buffer

PREFIX = 32
MiB = 1 << 20


def write_prefixes(kv: Client, block: int, count: int, rng: np.random.Generator) -> list[list[bytes]]:
    """``count`` unchained 32-block prefixes of ``block`` bytes (8 distinct payloads reused)."""
    payloads = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(8)]
    prefixes = []
    for p in range(count):
        keys = [rng.bytes(16) for _ in range(PREFIX)]
        results = kv.put("bench", keys, [payloads[(p + i) % 8] for i in range(PREFIX)], chained=False)
        if not all(r.ok for r in results):
            raise RuntimeError(f"put refused: {results[0].reason}")
        prefixes.append(keys)
    return prefixes


class RawExtents:
    """A file of ``count`` prefix-sized extents written with O_DIRECT now, beside the store's segments; ``read(i)``
    reads the i-th of them in a shuffled order, each once (a repeated read could come from the host's cache; a
    separate file, so that a Get and a raw read never read the same bytes)."""

    def __init__(self, path: Path, block: int, count: int, rng: np.random.Generator):
        self.extent = PREFIX * record_bytes(block)
        self.buf = aligned_buffer(self.extent)
        self.buf[:] = rng.integers(0, 256, self.extent, dtype=np.uint8)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for j in range(count):
            os.pwrite(self.fd, self.buf, j * self.extent)
        self.order = rng.permutation(count)

    def read(self, i: int) -> None:
        os.preadv(self.fd, [self.buf], int(self.order[i % len(self.order)]) * self.extent)

    def close(self) -> None:
        os.close(self.fd)


def measure(block: int, count: int, lane: str, root: Path, bar: tqdm) -> dict:
    rng = np.random.default_rng(block)
    nvme_dir = root / f"nvme-{block}"
    dram_needed = count * PREFIX * block * 5 // 4 + 64 * MiB
    cold_dram = max(32 * MiB, 3 * PREFIX * block)  # room to promote a Get's blocks; most prefixes only on NVMe
    with (
        store_process(
            "--dram",
            f"{cold_dram >> 20}MiB",
            "--nvme-dir",
            str(nvme_dir),
            "--nvme",
            "8GiB",
            "--write-policy",
            "write-through",
            "--shm-direct",
            "true",
        ) as (cold_target, _),
        store_process("--dram", f"{dram_needed >> 20}MiB", "--shm-direct", "true") as (warm_target, _),
        Client(cold_target, timeout=120, lane=lane) as cold,
        Client(warm_target, timeout=120, lane=lane) as warm,
    ):
        prefixes = write_prefixes(cold, block, count, rng)
        warm_prefixes = write_prefixes(warm, block, count, np.random.default_rng(block))
        raw = RawExtents(root / f"raw-{block}.bin", block, count, rng)
        out = [aligned_buffer(block) for _ in range(PREFIX)]
        times: dict[str, list[float]] = {"nvme": [], "dram": [], "raw": []}
        order = [int(i) for i in rng.permutation(count)]
        try:
            for i, p in enumerate(order):
                steps = (
                    ("nvme", lambda: cold.get("bench", prefixes[p], out=out)),
                    ("dram", lambda: warm.get("bench", warm_prefixes[p], out=out)),
                    ("raw", lambda: raw.read(i)),
                )
                for name, step in steps[i % 3 :] + steps[: i % 3]:
                    t0 = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - t0)
                bar.update(1)
        finally:
            raw.close()
        tiers = {t["name"]: t for t in cold.stats()["tiers"]}
    p50 = {k: statistics.median(v) for k, v in times.items()}
    payload = PREFIX * block
    return {
        "block_bytes": block,
        "lane": lane,
        "prefixes": count,
        "get_nvme_p50_ms": p50["nvme"] * 1e3,
        "get_dram_p50_ms": p50["dram"] * 1e3,
        "raw_extent_p50_ms": p50["raw"] * 1e3,
        "nvme_vs_raw": p50["raw"] / p50["nvme"],
        "get_nvme_gbps": payload / p50["nvme"] / 1e9,
        "get_dram_gbps": payload / p50["dram"] / 1e9,
        "raw_extent_gbps": PREFIX * record_bytes(block) / p50["raw"] / 1e9,
        "nvme_hits": tiers["nvme"]["hits"],
        "dram_hits": tiers["dram"]["hits"],
    }


def main(argv: list[str] | None = None) -> None:
    def configure(p):
        p.add_argument("--lane", default="auto", choices=("auto", "shm", "tcp", "grpc"), help="the client's data lane")
        p.add_argument(
            "--dir",
            type=Path,
            default=Path("/var/tmp"),
            help="where the stores keep their NVMe tiers (a disk, not tmpfs); removed afterwards",
        )

    args = parse_args("Gets of prefixes cached on NVMe through a kvstore serve process", argv, configure)
    sizes = {64 << 10: 48, 512 << 10: 12, 2 << 20: 6} if args.quick else {64 << 10: 256, 512 << 10: 48, 2 << 20: 16}
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvstore-nvme-get-", dir=args.dir))
    try:
        with tqdm(total=sum(sizes.values()), unit="prefix", desc="nvme gets") as bar:
            rows = [measure(block, count, args.lane, root, bar) for block, count in sizes.items()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        "Prefix Gets (32 blocks) through a kvstore serve process, p50, taken in turn with a raw read of the same "
        f"size from the store's segment files; lane {args.lane}:"
    )
    print(
        format_table(
            rows,
            [
                "block_bytes",
                "prefixes",
                "get_nvme_p50_ms",
                "get_dram_p50_ms",
                "raw_extent_p50_ms",
                "nvme_vs_raw",
                "get_nvme_gbps",
                "get_dram_gbps",
                "raw_extent_gbps",
                "nvme_hits",
                "dram_hits",
            ],
        )
    )
    if args.out:
        write_json(args.out, rows, args, bench="nvme_get")
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
