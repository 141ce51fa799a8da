"""Disk benchmark: the NVMe tier against the raw disk and a file-per-block store.

    python -m bench.disk [--quick] [--out bench/results/disk.json] [--dir /var/tmp/...]

In one run, every figure the median of 3 repetitions, with the raw disk, the
tier and the baseline measured in turn within each repetition (this shared
virtio disk drifts 2-3x between minutes, so only same-repetition figures are
compared):

(a) raw disk: sequential write then read of one file in 1 MiB O_DIRECT I/O at
    queue depth 1 (a Python pwrite/pread loop from a buffer in huge pages, as
    the tier's buffers are; ``--raw-tool fio``: fio with psync, whose buffer
    is 4 KiB pages; a fresh fallocated file each time, the write done when its
    O_DIRECT writes complete, as the tier's default ack);
(b) the NVMe tier: blocks of 64 KiB, 512 KiB and 2 MiB written as the
    store's write-back demotion writes them (``tier_write_gbps``: one
    ``write`` per ``DEMOTE_BATCH_BYTES`` of blocks, 64 MiB, the BlockStore's
    ``demote_batch_bytes``; the demoter moves that much per pass once DRAM is
    over its high watermark) and as a write-through Put of one 32-block
    prefix writes them (``tier_write_prefix_gbps``: one ``write`` per
    prefix), each acknowledged under the default ``direct`` policy (data on
    the device through O_DIRECT), then read back as
    whole prefixes (one ``read`` per prefix, CRC-checked, into reused buffers),
    in written order (``tier_read_gbps``, the pattern of the raw sequential
    read) and in shuffled order (``tier_read_shuffled_gbps``, the pattern of a
    cache; the file-per-block baseline reads in that order too). Sources and
    read destinations are page-aligned as DRAM-arena slots are (the store
    promotes a block read from NVMe into such a slot);
    ``tier_write_copied_gbps`` feeds the same bytes from unaligned memory
    (demotion batches); ``tier_write_fdatasync_gbps`` acknowledges 32-block
    prefixes after fdatasync instead;
(c) file-per-block (how LMCache's and vLLM's disk backends store chunks): one
    file per block with the same durability as the tier: written with O_DIRECT
    (``file_per_block_write_gbps``), or with an fdatasync per file and an fsync
    of the directory per prefix (``..._fdatasync_gbps``, against the tier's
    fdatasync policy); read back after dropping the page cache, one
    open/read/close per block, CRC-checked like the tier.

Also, as a ceiling for shuffled prefix reads: the raw file of (a) read in
extents of one prefix's size on disk (``raw_random_prefix_read_gbps``, 32 x
(4 KiB header + block), shuffled offsets, O_DIRECT, queue depth 1).

(d) Because the disk's speed drifts within seconds, the three reads are also
taken in turn, prefix by prefix, each prefix read once (``*_interleaved``):
the tier's shuffled prefix reads, file-per-block's (page cache dropped) and a
raw O_DIRECT read of another prefix's extent in the tier's own segment files;
``tier_vs_fpb_read_interleaved`` and ``tier_vs_raw_prefix_read_interleaved``
are the medians of the per-repetition ratios.

Throughput counts payload bytes only (the tier also writes a 4 KiB header per
record), except the raw figures, which count every byte read. It also times recovery of a tier of 100,000 blocks (4 KiB payloads,
8 KiB records): after a clean close (segment summaries), after a crash (no
checkpoint; the last segment scanned record by record) and with every summary
lost (a full scan, every header and payload CRC checked).

Targets: tier >= 0.8x raw for every block size; >= 3x file-per-block at 64 KiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from bench.common import format_table, parse_args, write_json
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.format import crc32c, record_bytes, split_loc
from kvstore.tiers.nvme.io import aligned_buffer
from kvstore.tiers.nvme.segments import segment_path

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12 (collections.abc.Buffer's too)
    from typing_extensions import Buffer

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PREFIX = 32
DEMOTE_BATCH_BYTES = 64 * MiB  # kvstore.store.blockstore.BlockStore(demote_batch_bytes=...) default
BLOCK_SIZES = (64 * KiB, 512 * KiB, 2 * MiB)
REPS = 3


def drop_page_cache(paths: list[Path]) -> None:
    """Evict files from the page cache (fadvise; drop_caches as well where we may)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        pass


# -- (a) raw disk ----------------------------------------------------------------------
def prefix_extent(block: int) -> int:
    """Bytes on disk of one 32-block prefix in the tier (header page + padded payload per record)."""
    return PREFIX * record_bytes(block)


def raw_fio(path: Path, size: int, extents: tuple[int, ...] = ()) -> tuple[float, float, dict[int, float]]:
    """One sequential write (a fresh fallocated file; done when the O_DIRECT writes complete, as the
    tier's default acknowledgement) and one sequential read, 1 MiB O_DIRECT I/O, queue depth 1; then, per
    extent size, the same file read in extents of that size at shuffled offsets (queue depth 1): the disk's
    own speed at the tier's shuffled prefix reads."""
    common = [
        "fio",
        "--name=raw",
        f"--filename={path}",
        "--direct=1",
        "--ioengine=psync",
        f"--size={size}",
        "--output-format=json",
    ]

    def run(rw: str, bs: int) -> float:
        out = subprocess.run(common + [f"--rw={rw}", f"--bs={bs}"], capture_output=True, text=True, check=True)
        job = json.loads(out.stdout)["jobs"][0]
        bw_bytes: int = job["write" if rw == "write" else "read"]["bw_bytes"]
        return bw_bytes / 1e9

    path.unlink(missing_ok=True)
    w = run("write", MiB)
    r = run("read", MiB)
    rand = {e: run("randread", e) for e in extents}
    path.unlink(missing_ok=True)
    return w, r, rand


def raw_python(path: Path, size: int, extents: tuple[int, ...] = ()) -> tuple[float, float, dict[int, float]]:
    """The same as raw_fio, as a Python pwrite/pread loop (where fio is not installed)."""
    buf = aligned_buffer(max((MiB, *extents)))
    buf[:] = np.random.default_rng(0).integers(0, 256, buf.nbytes, dtype=np.uint8)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.posix_fallocate(fd, 0, size)
    t0 = time.perf_counter()
    for off in range(0, size, MiB):
        os.pwrite(fd, cast("Buffer", buf[:MiB]), off)
    w = size / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for off in range(0, size, MiB):
        os.preadv(fd, [cast("Buffer", buf[:MiB])], off)
    r = size / (time.perf_counter() - t0) / 1e9
    rand: dict[int, float] = {}
    for e in extents:
        offsets = np.random.default_rng(e).permutation(size // e) * e
        t0 = time.perf_counter()
        for off in offsets:
            os.preadv(fd, [cast("Buffer", buf[:e])], int(off))
        rand[e] = len(offsets) * e / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    path.unlink(missing_ok=True)
    return w, r, rand


# -- workloads -----------------------------------------------------------------------------
class Workload:
    """``count`` blocks of ``block`` bytes in 32-block prefixes.

    Payloads are views of 64 distinct random blocks in one page-aligned pool, as
    the DRAM arena's slots are (the tier writes them in place); ``unaligned()``
    gives the same bytes from a misaligned pool (the tier copies those once).
    """

    def __init__(self, block: int, total: int, seed: int = 0):
        self.block = block
        self.count = max(PREFIX, total // block // PREFIX * PREFIX)
        rng = np.random.default_rng(seed)
        self.pool = aligned_buffer(block * 64)
        self.pool[:] = rng.integers(0, 256, block * 64, dtype=np.uint8)
        self.payloads = [self.pool[(i % 64) * block : (i % 64 + 1) * block] for i in range(self.count)]
        crcs = [crc32c(p) for p in self.payloads[:64]]
        self.metas = [
            BlockMeta("bench", rng.bytes(16), b"", 0, "bfloat16", block, block, crcs[i % 64]) for i in range(self.count)
        ]
        self.order = rng.permutation(self.count // PREFIX)
        slots = aligned_buffer(block * PREFIX)  # read into page-aligned slots, as a DRAM arena's are
        self.dests = [slots[i * block : (i + 1) * block] for i in range(PREFIX)]

    def unaligned(self) -> list[np.ndarray]:
        shifted = np.frombuffer(bytearray(self.pool.nbytes + 8), np.uint8)[8:]
        shifted[:] = self.pool
        b = self.block
        return [shifted[(i % 64) * b : (i % 64 + 1) * b] for i in range(self.count)]

    @property
    def nbytes(self) -> int:
        return self.count * self.block

    def prefixes(self) -> range:
        return range(0, self.count, PREFIX)


# -- (b) the tier ------------------------------------------------------------------------------
def tier_once(
    root: Path,
    w: Workload,
    *,
    read: bool = True,
    policy: str = "direct",
    payloads: list[np.ndarray] | None = None,
    per_call: int = PREFIX,
) -> dict[str, float]:
    """Write every block, ``per_call`` blocks per ``write``; then read every prefix in written order, then in
    shuffled order."""
    d = root / "tier"
    shutil.rmtree(d, ignore_errors=True)
    tier = NvmeTier(d, w.nbytes * 2 + GiB, segment_bytes=256 * MiB, write_policy=policy)
    src = payloads if payloads is not None else w.payloads
    locs: list[int] = []
    t0 = time.perf_counter()
    for i in range(0, w.count, per_call):
        locs += tier.write(w.metas[i : i + per_call], src[i : i + per_call])
    out = {"w": w.nbytes / (time.perf_counter() - t0) / 1e9}
    if read:
        lengths = [w.block] * PREFIX
        for key, order in (("r", range(w.count // PREFIX)), ("r_shuffled", w.order)):
            t0 = time.perf_counter()
            for p in order:
                tier.read(locs[p * PREFIX : (p + 1) * PREFIX], lengths, w.dests)
            out[key] = w.nbytes / (time.perf_counter() - t0) / 1e9
        assert w.dests[5].tobytes() == w.payloads[int(w.order[-1]) * PREFIX + 5].tobytes()
    tier.close()
    shutil.rmtree(d, ignore_errors=True)
    return out


# -- (c) file per block -------------------------------------------------------------------------
def write_files(d: Path, w: Workload, *, sync: bool = False) -> tuple[list[Path], float]:
    """One file per block, as LMCache's and vLLM's disk backends keep chunks; returns the paths and the
    seconds it took. ``sync=False``: each file written with O_DIRECT (data on the device when the write
    returns, like the tier's default policy); ``sync=True``: plus fdatasync of each file and an fsync of
    the directory per 32-block prefix (like the tier's fdatasync policy)."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    paths = [d / f"{m.hash.hex()}.bin" for m in w.metas]
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    t0 = time.perf_counter()
    for i in w.prefixes():
        for j in range(i, i + PREFIX):
            fd = os.open(paths[j], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            os.write(fd, cast("Buffer", w.payloads[j]))  # page-aligned source, 4 KiB-multiple length: O_DIRECT works
            if sync:
                os.fdatasync(fd)
            os.close(fd)
        if sync:
            os.fsync(dfd)
    seconds = time.perf_counter() - t0
    os.close(dfd)
    return paths, seconds


def read_files(paths: list[Path], w: Workload, prefix: int) -> None:
    """Read one prefix's files (one open/read/close per block) into the workload's slots, CRC-checked."""
    for j in range(prefix * PREFIX, (prefix + 1) * PREFIX):
        dest = w.dests[j - prefix * PREFIX]
        with open(paths[j], "rb", buffering=0) as f:
            n = f.readinto(cast("Buffer", dest))
        if n != w.block or crc32c(dest) != w.metas[j].crc32c:
            raise RuntimeError(f"file-per-block read back wrong bytes for {paths[j]}")


def file_per_block_once(root: Path, w: Workload, *, sync: bool = False, read: bool = True) -> tuple[float, float]:
    """Write every block to its own file, then (``read``) read them back in shuffled prefix order after
    dropping the page cache."""
    d = root / "files"
    paths, wt = write_files(d, w, sync=sync)
    rate_r = float("nan")
    if read:
        drop_page_cache(paths)
        t0 = time.perf_counter()
        for p in w.order:
            read_files(paths, w, int(p))
        rate_r = w.nbytes / (time.perf_counter() - t0) / 1e9
    shutil.rmtree(d, ignore_errors=True)
    return w.nbytes / wt / 1e9, rate_r


# -- (d) the three reads in turn, prefix by prefix -----------------------------------------------
def interleaved_reads(root: Path, w: Workload, fw: Workload) -> dict[str, float]:
    """The tier's shuffled prefix reads, file-per-block's and the raw disk's, taken in turn prefix by
    prefix so that all three see the disk in the same state (its speed drifts within seconds, so figures
    taken a few seconds apart disagree). Raw: one prefix's extent of the tier's own segment files, another
    prefix than the tier's, one O_DIRECT preadv at queue depth 1. Each prefix is read once."""
    d = root / "tier"
    shutil.rmtree(d, ignore_errors=True)
    tier = NvmeTier(d, w.nbytes * 2 + GiB, segment_bytes=256 * MiB)
    locs: list[int] = []
    for i in range(0, w.count, PREFIX):
        locs += tier.write(w.metas[i : i + PREFIX], w.payloads[i : i + PREFIX])
    paths, _ = write_files(root / "files", fw)
    drop_page_cache(paths)
    extent = prefix_extent(w.block)
    scratch = aligned_buffer(extent)
    fds: dict[int, int] = {}

    def raw(prefix: int) -> None:
        seg, off = split_loc(locs[prefix * PREFIX])
        if seg not in fds:
            fds[seg] = os.open(segment_path(d, seg), os.O_RDONLY | os.O_DIRECT)
        os.preadv(fds[seg], [cast("Buffer", scratch)], off)

    lengths = [w.block] * PREFIX
    rounds = min(len(w.order), len(fw.order))
    seconds = {"tier": 0.0, "fpb": 0.0, "raw": 0.0}
    try:
        for i in range(rounds):
            p, q = int(w.order[i]), int(w.order[-1 - i])
            steps: tuple[tuple[str, Callable[[], object]], ...] = (
                ("tier", lambda: tier.read(locs[p * PREFIX : (p + 1) * PREFIX], lengths, w.dests)),
                ("fpb", lambda: read_files(paths, fw, int(fw.order[i]))),
                ("raw", lambda: raw(q)),
            )
            for name, step in steps[i % 3 :] + steps[: i % 3]:  # each goes first in turn
                t0 = time.perf_counter()
                step()
                seconds[name] += time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
        tier.close()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(root / "files", ignore_errors=True)
    payload = rounds * PREFIX * w.block
    return {
        "tier": payload / seconds["tier"] / 1e9,
        "fpb": payload / seconds["fpb"] / 1e9,
        "raw": rounds * extent / seconds["raw"] / 1e9,
    }


# -- recovery ----------------------------------------------------------------------------------------
def recovery(root: Path, nblocks: int, reps: int = REPS) -> list[dict[str, Any]]:
    d = root / "recovery"
    shutil.rmtree(d, ignore_errors=True)
    size = 4 * KiB
    rng = np.random.default_rng(1)
    payload = np.frombuffer(rng.bytes(size), np.uint8)
    meta_crc = crc32c(payload)
    tier = NvmeTier(d, 4 * GiB, segment_bytes=256 * MiB)
    for i in range(0, nblocks, 512):
        n = min(512, nblocks - i)
        tier.write(
            [BlockMeta("bench", rng.bytes(16), b"", 0, "bfloat16", size, size, meta_crc) for _ in range(n)],
            [payload] * n,
        )
    tier.close()

    def reopen(prepare: Callable[[], None]) -> tuple[float, int]:
        prepare()
        t0 = time.perf_counter()
        t = NvmeTier(d, 4 * GiB, segment_bytes=256 * MiB)
        count = sum(1 for _ in t.recover())
        dt = time.perf_counter() - t0
        t.close()
        return dt, count

    def crash() -> None:
        (d / "checkpoint").unlink(missing_ok=True)
        sorted(d.glob("seg-*.sum"))[-1].unlink()

    def lose_summaries() -> None:
        for p in d.glob("seg-*.sum"):
            p.unlink()

    rows = []
    for case, prep in (
        ("clean close (summaries)", lambda: None),
        ("crash (active segment scanned)", crash),
        ("all summaries lost (full scan)", lose_summaries),
    ):
        runs = [reopen(prep) for _ in range(reps)]
        rows.append(
            {
                "recovery": case,
                "blocks": runs[0][1],
                "seconds": statistics.median(r[0] for r in runs),
                "payload_bytes": size,
            }
        )
    shutil.rmtree(d, ignore_errors=True)
    return rows


COLUMNS = [
    "block_bytes",
    "tier_write_gbps",
    "tier_read_gbps",
    "raw_write_gbps",
    "raw_read_gbps",
    "file_per_block_write_gbps",
    "file_per_block_read_gbps",
    "tier_vs_raw_write",
    "tier_vs_raw_read",
    "tier_vs_fpb_write",
    "tier_vs_fpb_read",
]
COLUMNS_MORE = [
    "block_bytes",
    "tier_write_prefix_gbps",
    "tier_vs_raw_write_prefix",
    "tier_read_shuffled_gbps",
    "tier_write_fdatasync_gbps",
    "file_per_block_write_fdatasync_gbps",
    "tier_vs_fpb_write_fdatasync",
    "tier_write_copied_gbps",
]
COLUMNS_INTERLEAVED = [
    "block_bytes",
    "interleaved_prefixes",
    "tier_read_interleaved_gbps",
    "file_per_block_read_interleaved_gbps",
    "raw_prefix_read_interleaved_gbps",
    "tier_vs_fpb_read_interleaved",
    "tier_vs_raw_prefix_read_interleaved",
]
COLUMNS_PREFIX_READ = [
    "block_bytes",
    "raw_random_prefix_read_gbps",
    "tier_read_shuffled_gbps",
    "tier_vs_raw_random_prefix_read",
    "file_per_block_read_gbps",
    "fpb_read_x3_vs_raw_random_prefix_read",
]


def bandwidth(root: Path, total: int, fpb_total: int, raw_total: int, raw_tool: str = "python") -> list[dict[str, Any]]:
    """Raw, tier and file-per-block interleaved within each repetition (the disk drifts between runs)."""
    raw = raw_fio if raw_tool == "fio" and shutil.which("fio") else raw_python
    work = {b: Workload(b, total) for b in BLOCK_SIZES}
    fpb_work = {b: Workload(b, fpb_total, seed=1) for b in BLOCK_SIZES}
    runs: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        runs.setdefault(key, []).append(value)

    for _ in range(REPS):
        rw, rr, rand = raw(root / "raw.bin", raw_total, tuple(prefix_extent(b) for b in BLOCK_SIZES))
        add("raw_w", rw)
        add("raw_r", rr)
        for b in BLOCK_SIZES:
            add(f"{b}_raw_prefix_r", rand[prefix_extent(b)])
        for b in BLOCK_SIZES:
            for k, v in tier_once(root, work[b], per_call=max(PREFIX, DEMOTE_BATCH_BYTES // b)).items():
                add(f"{b}_t{k}", v)
            add(f"{b}_tw_prefix", tier_once(root, work[b], read=False)["w"])
            add(f"{b}_tw_sync", tier_once(root, work[b], read=False, policy="fdatasync")["w"])
            add(
                f"{b}_tw_copy",
                tier_once(
                    root,
                    work[b],
                    read=False,
                    payloads=work[b].unaligned(),
                    per_call=max(PREFIX, DEMOTE_BATCH_BYTES // b),
                )["w"],
            )
            fw, fr = file_per_block_once(root, fpb_work[b])
            add(f"{b}_fw", fw)
            add(f"{b}_fr", fr)
            add(f"{b}_fw_sync", file_per_block_once(root, fpb_work[b], sync=True, read=False)[0])
            inter = interleaved_reads(root, work[b], fpb_work[b])
            for k, v in inter.items():
                add(f"{b}_ir_{k}", v)
            add(f"{b}_ir_tier_vs_fpb", inter["tier"] / inter["fpb"])  # ratios within a repetition
            add(f"{b}_ir_tier_vs_raw", inter["tier"] / inter["raw"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    rows = []
    for b in BLOCK_SIZES:
        tw, tr, fw, fr = med[f"{b}_tw"], med[f"{b}_tr"], med[f"{b}_fw"], med[f"{b}_fr"]
        rows.append(
            {
                "block_bytes": b,
                "tier_write_gbps": tw,
                "tier_read_gbps": tr,
                "tier_read_shuffled_gbps": med[f"{b}_tr_shuffled"],
                "raw_write_gbps": med["raw_w"],
                "raw_read_gbps": med["raw_r"],
                "file_per_block_write_gbps": fw,
                "file_per_block_read_gbps": fr,
                "tier_vs_raw_write": tw / med["raw_w"],
                "tier_vs_raw_read": tr / med["raw_r"],
                "tier_vs_fpb_write": tw / fw,
                "tier_vs_fpb_read": med[f"{b}_tr_shuffled"] / fr,
                "tier_write_prefix_gbps": med[f"{b}_tw_prefix"],
                "tier_vs_raw_write_prefix": med[f"{b}_tw_prefix"] / med["raw_w"],
                "tier_write_fdatasync_gbps": med[f"{b}_tw_sync"],
                "file_per_block_write_fdatasync_gbps": med[f"{b}_fw_sync"],
                "tier_vs_fpb_write_fdatasync": med[f"{b}_tw_sync"] / med[f"{b}_fw_sync"],
                "tier_write_copied_gbps": med[f"{b}_tw_copy"],
                "raw_random_prefix_read_gbps": med[f"{b}_raw_prefix_r"],
                "tier_vs_raw_random_prefix_read": med[f"{b}_tr_shuffled"] / med[f"{b}_raw_prefix_r"],
                "fpb_read_x3_vs_raw_random_prefix_read": 3 * fr / med[f"{b}_raw_prefix_r"],
                "tier_read_interleaved_gbps": med[f"{b}_ir_tier"],
                "file_per_block_read_interleaved_gbps": med[f"{b}_ir_fpb"],
                "raw_prefix_read_interleaved_gbps": med[f"{b}_ir_raw"],
                "tier_vs_fpb_read_interleaved": med[f"{b}_ir_tier_vs_fpb"],
                "tier_vs_raw_prefix_read_interleaved": med[f"{b}_ir_tier_vs_raw"],
                "interleaved_prefixes": min(work[b].count, fpb_work[b].count) // PREFIX,
                "raw_tool": "fio" if raw is raw_fio else "python",
                "runs": {k: v for k, v in runs.items() if k.startswith((f"{b}_", "raw"))},
            }
        )
    return rows


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("/var/tmp/kvstore-bench-disk"),
        help="scratch directory on the disk under test (not tmpfs); removed afterwards",
    )
    p.add_argument(
        "--raw-tool",
        choices=("python", "fio"),
        default="python",
        help="the raw disk's baseline: a pwrite/pread loop from a buffer in huge pages, as the tier's are (default), "
        "or fio's psync engine, whose buffer is 4 KiB pages (on this VM O_DIRECT from those ran 0.2-0.4x as fast: "
        "docs/nvme.md, 'The memory a read lands in')",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(
        "NVMe tier vs raw disk vs file-per-block",
        argv,
        configure=_options,
    )
    root: Path = args.dir
    root.mkdir(parents=True, exist_ok=True)
    total = 64 * MiB if args.quick else 1 * GiB
    fpb_total = 16 * MiB if args.quick else 256 * MiB
    try:
        rows = bandwidth(root, total, fpb_total, raw_total=128 * MiB if args.quick else 2 * GiB, raw_tool=args.raw_tool)
        for r in recovery(root, 100_000, reps=1 if args.quick else REPS):
            rows.append(
                {
                    "block_bytes": r["payload_bytes"],
                    "recovery": r["recovery"],
                    "recovery_blocks": r["blocks"],
                    "recovery_seconds": r["seconds"],
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bw = [r for r in rows if "tier_write_gbps" in r]
    print(
        f"NVMe tier vs raw disk ({bw[0]['raw_tool']}, 1 MiB O_DIRECT, qd 1) vs file-per-block; "
        f"GB/s of payload, median of {REPS}, interleaved"
    )
    print(format_table(bw, COLUMNS))
    print(
        "\nTier reading prefixes in shuffled order (file-per-block reads in that order too); acknowledged after "
        "fdatasync (power-loss durable); fed from unaligned memory (copied once):"
    )
    print(format_table(bw, COLUMNS_MORE))
    print(
        "\nShuffled prefix reads against the disk reading the same extents (one prefix's records) at shuffled "
        "offsets, queue depth 1 (fpb_read_x3_vs_...: > 1 means 3x file-per-block is beyond the disk):"
    )
    print(format_table(bw, COLUMNS_PREFIX_READ))
    print(
        "\nThe same three reads taken in turn, prefix by prefix (tier, file-per-block, raw extent of the tier's "
        "segment files), so all see the disk in the same state:"
    )
    print(format_table(bw, COLUMNS_INTERLEAVED))
    print(
        f"\nRecovery of 100,000 blocks (4 KiB payloads, 8 KiB records), "
        f"{'one run (--quick)' if args.quick else f'median of {REPS}'}:"
    )
    print(format_table([r for r in rows if "recovery" in r], ["recovery", "recovery_blocks", "recovery_seconds"]))
    if args.out:
        write_json(args.out, rows, args, bench="disk")
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
