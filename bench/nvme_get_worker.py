"""One side of ``bench.nvme_get``: store processes and clients of one source tree, driven step by step.

    python bench/nvme_get_worker.py BLOCK COUNT ROOT COLD_DRAM [--with-disk-store [--with-asked-disk-store]]
                                    [STORE OPTION...]
    (PYTHONPATH and cwd: the tree to measure)

Starts a store with an NVMe tier (write-through, DRAM ``COLD_DRAM``), with ``--with-disk-store`` the same with
``--share-nvme`` (its clients read NVMe blocks from the tier's files themselves: kind ``disk-shm``; with
``--with-asked-disk-store`` a second such store with ``--dram-index false``, whose every Get is asked: kind
``diskasked-shm``), and one whose DRAM holds everything, all
``kvstore serve`` processes of the tree on ``PYTHONPATH``, warms every client up (``Client.warm_up``, where the
tree has it: until its kernels were compiled an shm client had the store read its NVMe blocks, which promoted
them, beside the measured Gets), writes ``WARM`` 32-block prefixes per DRAM kind,
prints ``ready``, then answers lines on stdin: ``write I`` writes prefix ``I`` of each NVMe kind (each such
Get reads a prefix once: a repeated read could come from a cache); ``flush`` then writes more than DRAM holds
of other prefixes to each NVMe store, which push the last measured ones out of DRAM (write-through keeps the newest
blocks in DRAM: without it a Get of those was a DRAM hit); ``KIND I`` runs the Get of prefix ``I`` of ``KIND`` (``nvme-shm``, ``nvme-tcp``, ``nvme-grpc``, ``nvme-pool``: the
shm lane into slots of a ``shared_pool`` the client offered the store, which reads NVMe blocks straight into them,
``dram-shm``, ``dram-pool`` (the same into a pool of its own),
``dram-tcp``, ``dram-grpc``, ``disk-shm``, ``diskasked-shm``) into page-aligned buffers and prints its seconds; ``rawdst PATH
OFFSET`` reads a prefix-sized extent of ``PATH`` with one O_DIRECT ``preadv`` into those same buffers (each 4 KiB
record header into a page of its own) and prints its seconds: the disk's speed into the very memory the Gets
fill; ``stats`` prints the NVMe store's tier hits as JSON; ``cpu`` prints each store process's CPU seconds so far
(user and system, all its threads: ``nvme``, ``dram``, ``disk``, ``diskasked``) as JSON; ``quit`` stops. Only public names are used, so an older tree runs it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore.client import Client
from kvstore.config import ServeConfig
from kvstore.server.process import store_process
from kvstore.tiers.nvme.io import aligned_buffer

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12 (collections.abc.Buffer's too)
    from typing_extensions import Buffer

PREFIX = 32
KINDS = (
    *(
        "nvme-shm",
        "nvme-tcp",
        "nvme-grpc",
        "nvme-pool",
        "dram-shm",
        "dram-pool",
        "dram-tcp",
        "dram-grpc",
        "disk-shm",
        "diskasked-shm",
    ),
)
LANES = {"pool": "shm"}  # nvme-pool, dram-pool: the shm lane, into a shared pool the client offered the store
POOL_KINDS = ("nvme-pool", "dram-pool")
DISK_FLAG = "--with-disk-store"  # start the disk-shm store (the tree must know --share-nvme)
ASKED_FLAG = "--with-asked-disk-store"  # and a second one without the DRAM index (kind diskasked-shm)
WARM = 4  # prefixes of the all-DRAM store, taken in turn
DRAM_KINDS = ("dram-shm", "dram-tcp", "dram-grpc", "dram-pool")  # each with WARM prefixes of its own there


# the store-read kinds' store reads every NVMe block itself; a tree whose --share-nvme is auto (on without tenants)
# is told so, older trees (a --baseline) read them that way by default
STORE_READS = (
    ("--share-nvme", "false") if {f.name: f.default for f in fields(ServeConfig)}.get("share_nvme") == "auto" else ()
)


def write_prefix(kv: Client, payloads: list[np.ndarray], p: int, rng: np.random.Generator) -> list[bytes]:
    """One unchained 32-block prefix (the 8 distinct payloads reused in turn); its keys."""
    keys = [rng.bytes(16) for _ in range(PREFIX)]
    results = kv.put("bench", keys, [payloads[(p + i) % 8] for i in range(PREFIX)], chained=False)
    if not all(r.ok for r in results):
        raise RuntimeError(f"put refused: {results[0].reason}")
    return keys


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` (every thread) so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(block: int, count: int, root: Path, cold_dram: int, extra: list[str]) -> None:
    disk_store = DISK_FLAG in extra
    asked_store = ASKED_FLAG in extra
    extra = [a for a in extra if a not in (DISK_FLAG, ASKED_FLAG)]
    rng = np.random.default_rng(block)
    warm_dram = len(DRAM_KINDS) * WARM * PREFIX * block * 5 // 4 + (64 << 20)  # all of them, never evicted
    with contextlib.ExitStack() as stack:
        procs: dict[str, int] = {}  # store -> pid
        cold_target, cold = stack.enter_context(
            store_process(
                *("--dram", f"{cold_dram >> 20}MiB", "--nvme-dir", str(root / "nvme"), "--nvme", "16GiB"),
                *("--write-policy", "write-through", "--shm-direct", "true", *STORE_READS, *extra),
            )
        )
        warm_target, warm = stack.enter_context(
            store_process("--dram", f"{warm_dram >> 20}MiB", "--shm-direct", "true", *extra)
        )
        targets = {"nvme": cold_target, "dram": warm_target}
        procs.update(nvme=cold.pid, dram=warm.pid)
        if disk_store:  # the client reads the NVMe blocks of this one from its files (a tree with --share-nvme)
            targets["disk"], disk = stack.enter_context(
                store_process(
                    *("--dram", f"{cold_dram >> 20}MiB", "--nvme-dir", str(root / "nvme-shared"), "--nvme", "16GiB"),
                    *("--write-policy", "write-through", "--shm-direct", "true", "--share-nvme", "true", *extra),
                )
            )
            procs["disk"] = disk.pid
        if asked_store:  # the same, every Get asked of the store: what the DRAM index's disk entries save
            targets["diskasked"], asked = stack.enter_context(
                store_process(
                    *("--dram", f"{cold_dram >> 20}MiB", "--nvme-dir", str(root / "nvme-asked"), "--nvme", "16GiB"),
                    *("--write-policy", "write-through", "--shm-direct", "true", "--share-nvme", "true", *extra),
                    *("--dram-index", "false"),
                )
            )
            procs["diskasked"] = asked.pid
        clients = {
            kind: stack.enter_context(
                Client(targets[kind.split("-")[0]], timeout=120, lane=LANES.get(kind.split("-")[1], kind.split("-")[1]))
            )
            for kind in KINDS
            if kind.split("-")[0] in targets
        }
        for kv in clients.values():  # lanes opened and kernels compiled before any Get, as the connectors do
            warm_up = getattr(kv, "warm_up", None)  # (an older tree's client may not have it)
            if warm_up is not None:
                warm_up()
        shared: dict[str, list[np.ndarray]] = {}  # each pool kind's slots: in a pool the store maps
        pool_huge = False
        for kind in POOL_KINDS:
            if not hasattr(clients[kind], "shared_pool"):  # a tree without them
                del clients[kind]
                continue
            shared_pool = clients[kind].shared_pool(PREFIX * block)
            pool_memory, pool_huge = shared_pool.array, shared_pool.huge_pages
            pool_memory[:] = 1  # faulted in before any Get, as the other pool
            shared[kind] = [pool_memory[k * block : (k + 1) * block] for k in range(PREFIX)]
        payloads = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(8)]
        # a DRAM hit may repeat a prefix (no disk under it): a few suffice, written now; NVMe prefixes are
        # written when told (``write I``), so the driver can interleave them with its other trees' and its raw
        # file's writes: this disk reads recently written data faster, and an order would favour the last
        prefixes: dict[str, list[list[bytes]]] = {kind: [] for kind in KINDS}
        for kind in DRAM_KINDS:
            if kind in clients:
                prefixes[kind] = [write_prefix(clients[kind], payloads, p, rng) for p in range(min(count, WARM))]
        pool = aligned_buffer(PREFIX * block)  # the Gets' page-aligned slots in one pool, as a KV pool's
        pool[:] = 1  # faulted in before any Get
        out = [pool[k * block : (k + 1) * block] for k in range(PREFIX)]
        headers = aligned_buffer(PREFIX * 4096)
        raw_iov: list[Buffer] = [
            part
            for k in range(PREFIX)
            for part in (memoryview(cast("Buffer", headers))[k * 4096 : (k + 1) * 4096], cast("Buffer", out[k]))
        ]
        raw_files: dict[str, int] = {}
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            if words[0] == "write":
                p = int(words[1])
                for kind in ("nvme-shm", "nvme-tcp", "nvme-grpc", "nvme-pool", "disk-shm", "diskasked-shm"):
                    if kind in clients:
                        prefixes[kind].append(write_prefix(clients[kind], payloads, p, rng))
                print("ok", flush=True)
                continue
            if words[0] == "flush":  # prefixes never read, past what DRAM holds: what was written is only on NVMe
                for kind in ("nvme-shm", "disk-shm", "diskasked-shm"):
                    if kind not in clients:
                        continue
                    for f in range(cold_dram // (PREFIX * block) + 1):
                        write_prefix(clients[kind], payloads, f, rng)
                print("ok", flush=True)
                continue
            if words[0] == "stats":
                tiers = {t["name"]: t["hits"] for t in clients["nvme-shm"].stats()["tiers"]}
                if "disk-shm" in clients:  # bytes its clients read from the NVMe files themselves
                    tiers["disk_named_bytes"] = (
                        clients["disk-shm"].stats()["counters"].get("lane_shm_disk_get_bytes", 0)
                    )
                for kind in ("disk-shm", "diskasked-shm"):  # blocks promoted into DRAM (by a Get, or in the background)
                    if kind in clients:
                        counters = clients[kind].stats()["counters"]
                        tiers[f"{kind.split('-')[0]}_promotions"] = counters.get("tier_dram_promotions", 0)
                if "nvme-pool" in clients:  # bytes its Gets' NVMe blocks reached the pool with, and its pages
                    counters = clients["nvme-pool"].stats()["counters"]
                    tiers["pool_bytes"] = counters.get("lane_shm_pool_get_bytes", 0)
                    tiers["pool_huge_pages"] = pool_huge
                print(json.dumps(tiers), flush=True)
                continue
            if words[0] == "cpu":
                print(json.dumps({name: cpu_seconds(pid) for name, pid in procs.items()}), flush=True)
                continue
            if words[0] == "rawdst":  # as the tier lays a prefix down: header page, payload, header page, ...
                fd = raw_files.get(words[1])
                if fd is None:
                    fd = raw_files[words[1]] = os.open(words[1], os.O_RDONLY | os.O_DIRECT)
                t0 = time.perf_counter()
                os.preadv(fd, raw_iov, int(words[2]))
                print(time.perf_counter() - t0, flush=True)
                continue
            kind, i = words[0], int(words[1])
            keys = prefixes[kind][i % len(prefixes[kind])]
            t0 = time.perf_counter()
            clients[kind].get("bench", keys, out=shared.get(kind, out))
            print(time.perf_counter() - t0, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
