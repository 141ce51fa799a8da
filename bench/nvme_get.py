"""What a decode worker sees for a prefix cached on NVMe: client Gets through a `kvstore serve` process.

    python -m bench.nvme_get [--quick] [--baseline REV] [--out bench/results/nvme_get.json]
                             [--share-dram auto|true|false] [--dram-index false] [--baseline-share-dram true]
                             [--baseline-disk-store true] [--baseline-pool true] [--settle-ms MS] [--shm-dir DIR]
                             [--kinds KIND,...] [--floor false]

For each block size (64 KiB, 512 KiB, 2 MiB), 32-block prefixes are written to three store processes of this
tree (``bench/nvme_get_worker.py``): one with an NVMe tier (write-through, so every block has an NVMe copy;
DRAM holds three prefixes, at least 32 MiB: room to promote what a Get reads while most prefixes are only on
NVMe), the same with ``--share-nvme`` and one whose DRAM holds everything. Each prefix is then fetched once, into
the page-aligned slots of one pool (``Client.get(out=...)``), as a paged KV pool's, and every kind of step is taken
in turn, prefix by prefix, in a rotating order, so that all see the disk and the loaded host in the same state:

- ``disk_shm``: a Get of a prefix that NVMe holds from the ``--share-nvme`` store, on the shared-memory lane:
  the store names each block's file and offset and the client reads it into its buffers itself (a block such a
  client reads again is promoted in the background; here each prefix is read once, so none is:
  ``disk_promotions`` counts what was, and ``bench.nvme_reread`` measures rereads);
- ``nvme_shm`` / ``nvme_tcp`` / ``nvme_grpc``: a Get of a prefix that NVMe holds, on the shared-memory lane
  (direct: the store reads each block and writes it into the client's buffers), on the TCP lane and on the gRPC
  stream (``lane="grpc"``);
- ``nvme_pool``: the same shm Get into the slots of a ``Client.shared_pool`` (a sealed memfd the client offered
  the store, which maps it): in huge pages the store reads each NVMe block straight into its slot, with no copy;
  in 4 KiB pages it reads into its staging and copies in with memcpy (``pool_nvme_vs_raw``;
  ``pool_vs_shm_speedup``: ``nvme_shm`` p50 over its own; ``pool_huge_pages``: which it was, ``pool_bytes``: what
  reached the pool that way). The pool takes hugetlb pages when enough are free (``sysctl vm.nr_hugepages=64``
  covers every block size here), else transparent huge pages where ``shmem_enabled`` allows them; ``dram_pool``:
  the all-DRAM store's Get into a pool of its own, its blocks copied through the store's mapping
  (``pool_dram_vs_shm_speedup``: ``dram_shm`` p50 over its own);
- ``dram_shm`` / ``dram_tcp`` / ``dram_grpc``: the same Get from the all-DRAM store (what the lane and server cost;
  ``grpc_dram_vs_raw``, ``tcp_dram_vs_raw``, ``shm_dram_vs_raw``: what each lane reaches of the raw read with no
  disk under it: a lane whose figure is under 1 hands out even DRAM blocks slower than the disk reads them, so its
  NVMe Gets cannot reach the disk's speed whatever the reads do; the bound of its ``nvme_vs_raw``. On this VM
  these carry the cores' idle between steps as well: ``bench.after_pause`` measures a TCP Get of DRAM hits 2.5x
  slower after 50 ms idle, the raw read 1.1x, and back to back at the bare socket's speed);
- ``raw``: one O_DIRECT ``preadv`` of a prefix-sized extent (32 x (4 KiB + block), as the tier lays a prefix
  down) of a file written beside the stores' segments, each extent read once (the disk's speed at the same
  amount of data: the baseline of ``nvme_vs_raw``). Every side's prefixes and extents are written interleaved,
  prefix by prefix in a rotating order: this virtual disk reads recently written data faster (the host's cache),
  and writing one side after the other made the last one look 1.2-1.7x faster (docs/nvme_log.md); ``raw_crc``: that
  read plus a CRC32C of the extent on one thread, after it (what a read costs that is checked, as the store's are);
- ``raw_dst``: the same read of another extent, by this tree's worker, into the very buffers its Gets fill (each
  record header into a page of its own): on this VM where the bytes land moves an O_DIRECT read's time several times over
  (0.9 to 3.4 ms for one 2.2 MB read, buffer by buffer: docs/nvme_log.md), so a Get is also compared with the
  disk read into its own memory (``disk_nvme_vs_raw_dst``);
- ``dram_floor``: what a checked DRAM hit costs at the least, in this process: each of 32 blocks taken from a
  256 MiB buffer at a rotating place (not in the CPU's caches, as the stores' blocks are not between steps)
  gets its CRC32C and one copy into a page-aligned buffer, on one thread (the baseline of ``shm_dram_vs_floor``);
- ``floor_shm`` / ``floor_tcp`` / ``floor_grpc`` (unless ``--floor false``): the same Get of a prefix of its own
  file from a process that only reads it with O_DIRECT, checks its CRC32Cs and hands the blocks to this process
  (``bench/nvme_floor.py``: no index, lease, promotion or lane protocol): the most a store-read lane in Python
  reaches on this host, so ``shm_nvme_vs_floor`` (``tcp_``, ``grpc_``; ``disk_`` and ``pool_`` against the shm
  floor) is the share of it the real store keeps and ``floor_server_cpu_ms`` its CPU per Get beside
  ``nvme_store_cpu_ms``;
- with ``--baseline REV``: the same steps (``old_*``) run by the code of git revision ``REV``, exported to a
  temporary directory, with store processes of its own: today's code against that one, in the same run
  (``--baseline-share-dram true`` starts them with ``--share-dram`` too; ``--baseline-disk-store true`` adds its own
  ``--share-nvme`` store, ``old_disk_shm``; ``--baseline-pool true`` its Gets into shared pools, ``old_nvme_pool``
  and ``old_dram_pool``, with ``pool_nvme_speedup``).

Steps run back to back: on a 2-core host a step also meets the after-reply work the one before left in its
store (a promotion's bookkeeping, the touches, evictions), which the raw read, one thread, minds least.
``--settle-ms 50`` pauses before every step: on the twenty-eighth session's VM that moved the 2 MiB ``disk_shm``
ratio from 0.61-0.72 to 0.74-0.80 and the TCP lane's from 0.27-0.34 to 0.38-0.44, and left 64 KiB and 512 KiB
as they were or lower (a Get after a pause runs colder); the figures of record are back to back.
``--kinds disk-shm`` (a comma list of the Get steps above, ``disk-shm`` as the worker names them) takes only those
Gets in turn with the raw reads (and the floor with ``dram-shm``): a lane with no other store's Gets beside it (the
``disk_shm`` Get of 32 x 64 KiB ran at 0.910 ms alone and 1.409 beside the seven other kinds here, thirty-fifth
session). The stores of the other kinds still start and are written to; they idle.

``--share-dram`` (auto by default: the stores' own default, which on a host like this one shares the arena) is
passed to this tree's stores. Sharing their DRAM arena, they share (unless ``--dram-index false``) their DRAM index
too: ``dram_shm`` Gets after a prefix's first are then served by the client from the index, unasked. The
``--share-nvme`` store's index names its NVMe-only blocks (beside the arena's where it is shared, else alone), and ``disk_shm`` Gets after the first read them unasked; unless
``--dram-index false``, a second such store without the index (``diskasked_shm``, every Get asked, as a default
store's were before the fifty-sixth session) runs beside it in the same worker, and ``disk_index_speedup`` is its
p50 over ``disk_shm``'s: what the index saves, measured without the bias between two trees' workers
(docs/nvme_log.md).

``--shm-dir DIR`` puts every store's shared files (the shared DRAM arena, the lanes' regions) in ``DIR``: /dev/shm
gives them 4 KiB pages as a rule, a tmpfs mounted ``huge=within_size`` huge pages, and the store-read lanes' NVMe
reads into the shared arena (promotions) run at about half the speed into 4 KiB pages here (docs/nvme_log.md,
thirty-second session); every row says which it was (``shm_dir_huge_pages``).

Rows: p50 ms of each step, ``shm_dram_vs_floor`` (floor / DRAM-hit Get), ``disk_nvme_vs_raw``, ``disk_nvme_vs_raw_dst``,
``shm_nvme_vs_raw``, ``tcp_nvme_vs_raw`` and ``grpc_nvme_vs_raw`` (raw time / Get time, 1 = as fast as the bare
disk), ``socket_gbps`` (loopback TCP of a prefix's payload between two processes, distinct memory on both sides:
``bench.baselines.raw_socket_gbps``) and ``tcp_ceiling_vs_raw`` (socket / raw speed, at most 1: what the tcp and
gRPC lanes, which move every byte over a socket, could reach of the raw read), ``dram_shm_speedup`` (old / new
p50 of the DRAM-hit Get) and the like, GB/s of payload; ``nvme_store_cpu_ms``, ``dram_store_cpu_ms``,
``disk_store_cpu_ms`` (and ``old_...``): the CPU each store process spent per Get it served, over all of them
(user and system, every thread, the work after each reply included), and ``nvme_store_cpu_vs_raw``: the NVMe store's
per Get over the raw read's time (above 1, two cores shared with the client cannot keep up with the disk).
Every buffer a disk reads into here (the pool, the raw read's) is in huge pages (``kvstore.hugepages``): on this
VM an O_DIRECT read into 4 KiB pages ran at 0.3-0.4x the speed (docs/nvme_log.md, twenty-ninth session), and which
pages a buffer drew had set the "disk state" that moved earlier runs. Only this machine's disk is measured; a real
NVMe drive changes the ``raw`` column, not what the store adds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.baselines import raw_socket_gbps
from bench.common import format_table, parse_args, write_json
from bench.nvme_floor import GETS as FLOOR_GETS
from bench.nvme_floor import Floor
from bench.nvme_raw import PREFIX, DramFloor, RawExtents
from kvstore.checksum import crc32c
from kvstore.config import ServeConfig
from kvstore.hugepages import files_get_huge_pages
from kvstore.tiers.nvme.format import record_bytes

MiB = 1 << 20


REPO = Path(__file__).resolve().parent.parent
KINDS = ("nvme-shm", "nvme-tcp", "nvme-grpc", "dram-shm", "dram-tcp")  # what a --baseline tree's worker runs
POOL_KINDS = ("nvme-pool", "dram-pool")  # and with --baseline-pool, a tree with shared pools
NEW_KINDS = (*KINDS, "dram-grpc", "disk-shm", "nvme-pool", "dram-pool")


# (row, numerator step, denominator step): p50 over p50. Against ``raw``: 1 = as fast as the bare disk.
RATIOS = (
    ("disk_nvme_vs_raw", "raw", "disk-shm"),
    # the same read into the memory the Get fills: on this VM where the bytes land moves an O_DIRECT read's time
    # several times over (docs/nvme_log.md), so this ratio is what the store adds to the disk, free of that
    ("disk_nvme_vs_raw_dst", "raw_dst", "disk-shm"),
    *((f"{lane}_nvme_vs_raw", "raw", f"nvme-{lane}") for lane in ("shm", "tcp", "grpc", "pool")),
    ("pool_vs_shm_speedup", "nvme-shm", "nvme-pool"),
    ("pool_dram_vs_shm_speedup", "dram-shm", "dram-pool"),
    *((f"old_{lane}_nvme_vs_raw", "raw", f"old_nvme-{lane}") for lane in ("shm", "tcp", "grpc")),
    *((f"{lane}_nvme_speedup", f"old_nvme-{lane}", f"nvme-{lane}") for lane in ("shm", "tcp", "grpc")),
    *((f"{lane}_dram_speedup", f"old_dram-{lane}", f"dram-{lane}") for lane in ("shm", "tcp")),
    ("old_pool_nvme_vs_raw", "raw", "old_nvme-pool"),
    ("pool_nvme_speedup", "old_nvme-pool", "nvme-pool"),
    ("pool_dram_speedup", "old_dram-pool", "dram-pool"),
    # each lane with no disk under it: what its NVMe Get can reach at the most
    ("grpc_dram_vs_raw", "raw", "dram-grpc"),
    ("grpc_nvme_vs_dram", "dram-grpc", "nvme-grpc"),
    *((f"{lane}_dram_vs_raw", "raw", f"dram-{lane}") for lane in ("shm", "tcp")),
    # the same --share-nvme Gets, asked of a store without the DRAM index
    ("diskasked_nvme_vs_raw", "raw", "diskasked-shm"),
    ("disk_index_speedup", "diskasked-shm", "disk-shm"),
    ("old_disk_nvme_vs_raw", "raw", "old_disk-shm"),
    ("disk_nvme_speedup", "old_disk-shm", "disk-shm"),
    ("shm_dram_vs_floor", "dram_floor", "dram-shm"),
    # with --floor: the least a Python store process takes for the same Get (bench/nvme_floor.py), against the disk,
    # and what the real store reaches of it
    *((f"{lane}_floor_vs_raw", "raw", f"floor-{lane}") for lane in ("shm", "tcp", "grpc")),
    *((f"{lane}_nvme_vs_floor", f"floor-{lane}", f"nvme-{lane}") for lane in ("shm", "tcp", "grpc")),
    # the shm lanes a client reads NVMe through (its own reads, a shared pool) against the same floor: the floor's
    # code is the same in every run, so this row is the one to compare between runs of one tree against another's
    # (the raw read's time moves the floor's ratio as much as any lane's: 7 % between two runs here)
    ("disk_nvme_vs_floor", "floor-shm", "disk-shm"),
    ("pool_nvme_vs_floor", "floor-shm", "nvme-pool"),
)


class Worker:
    """The store processes and clients of one source tree (``nvme_get_worker.py`` run against it)."""

    def __init__(self, tree: Path, block: int, count: int, root: Path, cold_dram: int, extra: tuple[str, ...] = ()):
        root.mkdir(parents=True, exist_ok=True)
        # this tree first, then whatever the caller's path holds (packages installed beside, e.g. with --target)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "nvme_get_worker.py"), str(block), str(count), str(root)]
            + [str(cold_dram), *extra],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._line() != "ready":
            raise RuntimeError(f"the worker of {tree} did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a bench worker died (its store output is above)")
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        try:
            self.ask("quit")
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def export_tree(rev: str, dest: Path) -> Path:
    """The files of git revision ``rev`` of this repository, in ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def measure(
    block: int,
    count: int,
    root: Path,
    bar: tqdm,
    baseline: Path | None = None,
    extra: tuple[str, ...] = (),
    old_extra: tuple[str, ...] = (),
    old_pool: bool = False,
    index_ab: bool = False,
    settle: float = 0.0,
    kinds: tuple[str, ...] = (),
    with_floor: bool = False,
) -> dict[str, Any]:
    rng = np.random.default_rng(block)
    cold_dram = max(32 * MiB, 3 * PREFIX * block)
    sides = {"": REPO} | ({"old_": baseline} if baseline is not None else {})
    workers: dict[str, Worker] = {}
    raw: RawExtents | None = None
    nvme_floor = Floor(root, block, count, np.random.default_rng(block + 1)) if with_floor else None
    try:
        for tag, tree in sides.items():
            args = (*extra, "--with-disk-store") if tag == "" else old_extra  # an old tree may know neither option
            if tag == "" and index_ab:
                args += ("--with-asked-disk-store",)
            workers[tag] = Worker(tree, block, count, root / f"{tag}store-{block}", cold_dram, args)
        raw = RawExtents(root / f"raw-{block}.bin", block, count, rng, dst_extents=True)
        writers = list(workers.values()) + [raw] + ([nvme_floor] if nvme_floor is not None else [])
        for i in range(count):  # interleaved, in a rotating order: no side's data is the most recently written
            k = i % len(writers)
            for w in writers[k:] + writers[:k]:
                if isinstance(w, (RawExtents, Floor)):
                    w.write(i)
                elif w.ask(f"write {i}") != "ok":
                    raise RuntimeError("a bench worker failed to write a prefix")
        for w in workers.values():  # the measured prefixes out of DRAM (the worker script is this tree's on all sides)
            if w.ask("flush") != "ok":
                raise RuntimeError("a bench worker failed to flush its stores' DRAM")
        if nvme_floor is not None:
            nvme_floor.start()
        old_disk = "--with-disk-store" in old_extra
        old_kinds = NEW_KINDS if old_disk else (*KINDS, *POOL_KINDS) if old_pool else KINDS
        steps = [(tag, kind) for tag in sides for kind in (NEW_KINDS if tag == "" else old_kinds)]
        steps += [("", "diskasked-shm")] if index_ab else []
        steps = [(tag, kind) for tag, kind in steps if not kinds or kind in kinds]
        steps += [("", "raw"), ("", "raw_dst")] + ([("", g) for g in FLOOR_GETS] if nvme_floor is not None else [])
        dram_floor = DramFloor(block) if ("", "dram-shm") in steps else None  # the DRAM-hit Get's baseline
        steps += [("", "dram_floor")] if dram_floor is not None else []
        times: dict[str, list[float]] = {f"{tag}{kind}": [] for tag, kind in steps}
        times["raw_crc"] = []
        order = [int(i) for i in rng.permutation(count)]
        cpu0 = {tag: json.loads(w.ask("cpu")) for tag, w in workers.items()}
        for r, p in enumerate(order):
            k = r % len(steps)
            for tag, kind in steps[k:] + steps[:k]:
                if settle:
                    time.sleep(settle)
                if kind == "dram_floor" and dram_floor is not None:
                    t0 = time.perf_counter()
                    dram_floor.run(r)
                    times["dram_floor"].append(time.perf_counter() - t0)
                elif kind in FLOOR_GETS and nvme_floor is not None:
                    times[kind].append(nvme_floor.take(kind, p))
                elif kind == "raw_dst":
                    times["raw_dst"].append(float(workers[""].ask(f"rawdst {raw.path} {raw.dst_offset(r)}")))
                elif kind == "raw":
                    t0 = time.perf_counter()
                    raw.read(r)
                    t1 = time.perf_counter()
                    crc32c(raw.buf)  # what checking the bytes read adds, as every read of the store's must
                    times["raw"].append(t1 - t0)
                    times["raw_crc"].append(time.perf_counter() - t0)
                else:
                    times[f"{tag}{kind}"].append(float(workers[tag].ask(f"{kind} {p}")))
            bar.update(1)
        cpu = {tag: json.loads(w.ask("cpu")) for tag, w in workers.items()}  # each store's CPU over the Gets
        hits = json.loads(workers[""].ask("stats"))
    finally:
        try:
            if raw is not None:
                raw.close()
            if nvme_floor is not None:
                nvme_floor.close()
        finally:  # the stores stop before the caller removes their directories, whatever failed above
            for w in workers.values():
                w.close()
    p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    payload = PREFIX * block
    row: dict[str, Any] = {"block_bytes": block, "prefixes": count}
    for name, ms in p50.items():
        row[f"{name.replace('-', '_')}_p50_ms"] = ms
    row["raw_extent_gbps"] = PREFIX * record_bytes(block) / p50["raw"] / 1e6
    for name, num, den in RATIOS:  # each where both steps ran (``--kinds`` takes some of them)
        if num in p50 and den in p50:
            row[name] = p50[num] / p50[den]
    steps_of = (
        ("disk", "disk-shm"),
        ("shm", "nvme-shm"),
        ("pool", "nvme-pool"),
        ("tcp", "nvme-tcp"),
        ("grpc", "nvme-grpc"),
    )
    for lane, step in steps_of:
        if step in p50:
            row[f"{lane}_nvme_gbps"] = payload / p50[step] / 1e6
    # what each store process spent (user + system, every thread, the work after each reply included) per Get it
    # served: on two cores shared with the client, the store-read lanes are bound by this more than by the disk
    for tag in cpu:
        for store, seconds in cpu[tag].items():
            served = sum(len(v) for k, v in times.items() if k.startswith(f"{tag}{store}-"))
            if served:
                row[f"{tag}{store}_store_cpu_ms"] = (seconds - cpu0[tag][store]) * 1e3 / served
    if nvme_floor is not None:
        row |= nvme_floor.cpu_rows(len(times[FLOOR_GETS[0]]))
    if "nvme_store_cpu_ms" in row:
        row["nvme_store_cpu_vs_raw"] = row["nvme_store_cpu_ms"] / p50["raw"]
    # a remote client's Get moves the bytes over a socket too: loopback TCP of a prefix's payload, distinct memory
    # to distinct memory, bounds what the tcp and gRPC lanes can reach of the raw read
    row["socket_gbps"] = raw_socket_gbps(payload, "get", reps=3, distinct=True)
    row["tcp_ceiling_vs_raw"] = min(1.0, row["socket_gbps"] / row["raw_extent_gbps"])
    row["nvme_hits"], row["dram_hits"] = hits["nvme"], hits["dram"]
    row["disk_named_bytes"] = hits.get("disk_named_bytes", 0)
    for store in ("disk", "diskasked"):  # the blocks each --share-nvme store promoted into DRAM, by any path
        if f"{store}_promotions" in hits:
            row[f"{store}_promotions"] = hits[f"{store}_promotions"]
    if "pool_bytes" in hits:  # what reached the shared pool without process_vm_writev, and whether in huge pages
        row["pool_bytes"], row["pool_huge_pages"] = hits["pool_bytes"], hits["pool_huge_pages"]
    return row


def main(argv: list[str] | None = None) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--baseline",
            default="",
            metavar="REV",
            help="also run the code of this git revision (exported to a temporary directory), step for step",
        )
        p.add_argument(
            "--share-dram",
            choices=("auto", "true", "false"),
            default="auto",
            help="this tree's stores' --share-dram (auto: the store's default, which shares the DRAM arena on a host "
            "like this one; shm Gets of DRAM blocks are then copied by the client)",
        )
        p.add_argument(
            "--baseline-share-dram",
            default="false",
            help="true: the --baseline tree's stores run with --share-dram too (it must know the option): "
            "what this tree adds to shared DRAM Gets, against that tree's",
        )
        p.add_argument(
            "--baseline-disk-store",
            default="false",
            help="true: the --baseline tree runs a --share-nvme store too (it must know the option), measured as "
            "old_disk-shm beside this tree's disk-shm",
        )
        p.add_argument(
            "--baseline-pool",
            choices=("true", "false"),
            default="false",
            help="true: the --baseline tree's Gets into shared pools too (it must have them), measured as "
            "old_nvme-pool and old_dram-pool beside this tree's",
        )
        p.add_argument(
            "--dram-index",
            default="true",
            help="this tree's stores share their DRAM index (of the --share-nvme store's NVMe-only blocks alone "
            "without --share-dram; false: every Get is asked, and no diskasked-shm store runs)",
        )
        p.add_argument(
            "--settle-ms",
            type=float,
            default=0.0,
            help="pause this long before every step (default 0: back to back), so that each starts on a host the "
            "last step's after-reply work (promotions, touches, evictions in the other stores) has left quiet",
        )
        p.add_argument(
            "--shm-dir",
            default="",
            metavar="DIR",
            help="the stores' --shm-dir (default theirs, /dev/shm): their shared DRAM arena and lanes' regions. "
            "A tmpfs mounted huge=within_size gives them huge pages, which /dev/shm as a rule does not "
            "(rows: shm_dir_huge_pages)",
        )
        p.add_argument(
            "--kinds",
            default="",
            metavar="KIND,...",
            help="only these Get steps (of " + ", ".join((*NEW_KINDS, "diskasked-shm")) + "), each in turn with "
            "the raw reads (and dram_floor with dram-shm): a lane with no other store's Gets beside it (default: every "
            "one)",
        )
        p.add_argument(
            "--dir",
            type=Path,
            default=Path("/var/tmp"),
            help="where the stores keep their NVMe tiers (a disk, not tmpfs); removed afterwards",
        )
        p.add_argument(
            "--floor",
            choices=("true", "false"),
            default="true",
            help="true (default): also take floor-shm, floor-tcp and floor-grpc steps, the same Gets from a process that only "
            "reads, checks and hands off (bench/nvme_floor.py): the most a store-read lane in Python reaches here",
        )

    args = parse_args("Gets of prefixes cached on NVMe through a kvstore serve process", argv, configure)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - {*NEW_KINDS, "diskasked-shm"})
    if unknown:
        raise SystemExit(f"--kinds: no step {', '.join(unknown)} (the steps: {', '.join(NEW_KINDS)}, diskasked-shm)")
    sizes = {64 << 10: 24, 512 << 10: 8, 2 << 20: 5} if args.quick else {64 << 10: 64, 512 << 10: 24, 2 << 20: 10}
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvstore-nvme-get-", dir=args.dir))
    try:
        baseline = export_tree(args.baseline, root / "baseline") if args.baseline else None
        with tqdm(total=sum(sizes.values()), unit="prefix", desc="nvme gets") as bar:
            extra: tuple[str, ...] = ("--share-dram", args.share_dram) if args.share_dram != "auto" else ()
            extra += ("--dram-index", args.dram_index)
            old: tuple[str, ...] = ("--share-dram", "true") if args.baseline_share_dram == "true" else ()
            old += ("--with-disk-store",) if args.baseline_disk_store == "true" else ()
            if args.shm_dir:
                extra, old = (*extra, "--shm-dir", args.shm_dir), (*old, "--shm-dir", args.shm_dir)
            index_ab = args.dram_index == "true"
            rows = [
                measure(
                    block,
                    count,
                    root,
                    bar,
                    baseline=baseline,
                    extra=extra,
                    old_extra=old,
                    old_pool=args.baseline_pool == "true",
                    index_ab=index_ab,
                    settle=args.settle_ms / 1e3,
                    kinds=kinds,
                    with_floor=args.floor == "true",
                )
                for block, count in sizes.items()
            ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    huge = files_get_huge_pages(args.shm_dir or ServeConfig.shm_dir)
    for row in rows:  # whether NVMe reads into a shared DRAM arena (promotions) and lane regions land in huge pages
        row["shm_dir_huge_pages"] = huge
    print(
        "Prefix Gets (32 blocks) through kvstore serve processes, p50 ms, each step taken in turn prefix by prefix "
        "with a raw O_DIRECT read of the same size" + (f"; old_ = the code of {args.baseline}" if args.baseline else "")
    )
    cols = ["block_bytes", "prefixes", "raw_p50_ms", "raw_crc_p50_ms", "raw_dst_p50_ms", "disk_shm_p50_ms"]
    cols += ["disk_nvme_vs_raw", "disk_nvme_vs_raw_dst"]
    if args.dram_index == "true":
        cols += ["diskasked_shm_p50_ms", "diskasked_nvme_vs_raw", "disk_index_speedup"]
    cols += ["nvme_shm_p50_ms", "shm_nvme_vs_raw", "nvme_pool_p50_ms", "pool_nvme_vs_raw", "pool_vs_shm_speedup"]
    cols += ["nvme_tcp_p50_ms", "tcp_nvme_vs_raw", "nvme_grpc_p50_ms"]
    cols += ["grpc_nvme_vs_raw", "dram_grpc_p50_ms", "grpc_dram_vs_raw", "grpc_nvme_vs_dram", "tcp_ceiling_vs_raw"]
    cols += ["dram_shm_p50_ms", "shm_dram_vs_raw", "dram_pool_p50_ms", "pool_dram_vs_shm_speedup"]
    cols += ["dram_floor_p50_ms", "shm_dram_vs_floor", "dram_tcp_p50_ms", "tcp_dram_vs_raw"]
    if args.floor == "true":
        for lane in ("shm", "tcp", "grpc"):
            cols += [
                f"floor_{lane}_p50_ms",
                f"{lane}_floor_vs_raw",
                f"{lane}_nvme_vs_floor",
                f"floor_{lane}_thread_cpu_ms",
            ]
        cols += ["disk_nvme_vs_floor", "pool_nvme_vs_floor", "floor_server_cpu_ms"]
        cols += ["nvme_store_cpu_ms"]
    if args.baseline:
        cols += ["old_nvme_shm_p50_ms", "old_shm_nvme_vs_raw", "old_nvme_tcp_p50_ms", "old_tcp_nvme_vs_raw"]
        cols += ["old_dram_shm_p50_ms", "shm_dram_speedup", "old_dram_tcp_p50_ms", "tcp_dram_speedup"]
        if args.baseline_disk_store == "true":
            cols += ["old_disk_shm_p50_ms", "old_disk_nvme_vs_raw", "disk_nvme_speedup"]
    print(format_table(rows, cols))
    print(
        format_table(
            rows,
            ["block_bytes", "raw_extent_gbps", "socket_gbps", "disk_nvme_gbps", "shm_nvme_gbps", "pool_nvme_gbps"]
            + ["tcp_nvme_gbps", "grpc_nvme_gbps"],
        )
    )
    if args.out:
        write_json(args.out, rows, args, bench="nvme_get")
        print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
