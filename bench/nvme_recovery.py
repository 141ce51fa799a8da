"""NVMe tier recovery at scale: how long a store takes to reopen a segment log of millions of blocks.

``python -m bench.nvme_recovery [--quick] [--out FILE.json] [--blocks N] [--dir DIR]``

Builds a data directory the way the tier leaves it after a crash: sealed
segments with their summaries (``seg-*.sum``, the columnar sidecar recovery
loads instead of scanning; the segment files themselves are sparse, since a
summary is trusted without reading payloads), a checkpoint naming some dead
records, and a tail segment of real records with no summary, which recovery
scans and verifies record by record. Payloads are one page each (tiny
payloads do not change what recovery reads: summaries and the tail).

Then, each in a fresh process: ``recover_log`` alone (the tier's own pass:
summaries, checkpoint, newest record per key), and opening a ``BlockStore``
over an ``NvmeTier`` on that directory (the tier's pass plus indexing every
recovered block and the eviction policy's bookkeeping), for the compact index
and for c9edcad's store and index (``bench.index_scale`` checks them out from
git; both run over the current tier), with each of ``--policies``. Rows carry
seconds, blocks recovered and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Row, report

RECORDS_PER_SEGMENT = 32_768  # 256 MiB segments of 8 KiB records (a header page and one payload page)
TAIL_RECORDS = 2_000


def _summary_bytes(seg_id: int, first_seq: int, n: int, rng: np.random.Generator) -> bytes:
    """A summary in the layout kvstore/tiers/nvme/sidecar.py documents, made from numpy columns."""
    import struct

    from kvstore.tiers.nvme.format import crc32c

    parts = [struct.pack("<4sHHQQIII", b"KVSS", 1, 0, seg_id, n * 8192, n, 1, 1)]
    parts += [struct.pack("<H", 2), b"ns", bytes([8]), b"bfloat16"]
    keys = rng.integers(0, 1 << 64, size=(n, 2), dtype=np.uint64, endpoint=False)
    parents = np.zeros_like(keys)
    parents[1:] = keys[:-1]
    has = np.ones(n, dtype=np.uint8)
    has[::64] = 0
    parents[has == 0] = 0
    cols = [
        (np.arange(n, dtype="<u4") * 2),  # offset in pages: 2 pages a record
        np.arange(first_seq, first_seq + n, dtype="<u8"),
        keys,
        parents,
        has,
        np.zeros(n, dtype="<u4"),
        np.zeros(n, dtype="<u2"),
        np.zeros(n, dtype="<u4"),
        np.full(n, 4096, dtype="<u8"),
        np.full(n, 4096, dtype="<u8"),
        np.zeros(n, dtype="<u4"),
        np.zeros(n, dtype="<u4"),
    ]
    parts += [c.tobytes() for c in cols]
    body = b"".join(parts)
    return body + struct.pack("<I", crc32c(body))


def build(data_dir: Path, blocks: int) -> None:
    """Sealed segments with summaries, a checkpoint with some dead records, and a scanned tail."""
    from kvstore.checksum import crc32c
    from kvstore.tiers.base import BlockMeta
    from kvstore.tiers.nvme.sidecar import Checkpoint, write_checkpoint
    from kvstore.tiers.nvme.tier import NvmeTier

    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(5)
    sealed = blocks - TAIL_RECORDS
    seg_id, seq = 1, 1
    while sealed > 0:
        n = min(RECORDS_PER_SEGMENT, sealed)
        with open(data_dir / f"seg-{seg_id:010d}.log", "wb") as f:
            f.truncate(n * 8192)
        (data_dir / f"seg-{seg_id:010d}.sum").write_bytes(_summary_bytes(seg_id, seq, n, rng))
        seg_id, seq, sealed = seg_id + 1, seq + n, sealed - n
    dead = {1: np.arange(0, 200, 2, dtype=np.uint32) * 2}  # 100 records of segment 1 were freed
    write_checkpoint(data_dir, Checkpoint(seq, seg_id, dead))
    # the tail: real records written through the tier, then its summary removed as a crash leaves it
    tier = NvmeTier(data_dir, 1 << 40, write_policy="direct")
    payload = np.zeros(4096, dtype=np.uint8)
    metas = [
        BlockMeta("ns", rng.bytes(16), b"", 0, "bfloat16", 4096, 4096, crc32c(payload)) for _ in range(TAIL_RECORDS)
    ]
    for i in range(0, TAIL_RECORDS, 256):
        tier.write(metas[i : i + 256], [payload] * len(metas[i : i + 256]))
    tier.close()
    last = max(int(p.name[4:14]) for p in data_dir.glob("seg-*.log"))
    for p in data_dir.glob(f"seg-{last:010d}.sum"):
        p.unlink()
    (data_dir / "checkpoint").unlink()
    write_checkpoint(data_dir, Checkpoint(seq, seg_id, dead))


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(case: dict[str, Any]) -> Row:
    data_dir, what, impl, policy = Path(case["dir"]), case["what"], case["impl"], case.get("policy", "freq")
    from kvstore.tiers.accounting import AccountingMemoryTier
    from kvstore.tiers.base import DRAM
    from kvstore.tiers.nvme.io import PosixBackend
    from kvstore.tiers.nvme.recovery import recover_log
    from kvstore.tiers.nvme.tier import NvmeTier

    work = Path(tempfile.mkdtemp())
    # recovery writes summaries and deletes dead segments: each case gets its own directory of hard links
    shutil.copytree(data_dir, work / "d", copy_function=os.link)
    start = time.perf_counter()
    if what == "recover_log":
        out = recover_log(work / "d", PosixBackend())
        blocks = out.count  # not len(out.winners): that builds a BlockMeta per block
        extra: dict[str, float] = {"scanned": out.scanned, "summarized": out.summarized}
    else:
        if impl == "compact":
            from kvstore.store import blockstore, policies
        else:
            from bench.index_scale import load_baseline

            _, blockstore, policies = load_baseline(work)
        tier = NvmeTier(work / "d", 1 << 40, write_policy="direct")
        store = blockstore.BlockStore(
            [AccountingMemoryTier(1 << 40, rank=DRAM), tier], policy_factory=policies.policy_factory(policy)
        )
        blocks = store.stats()["blocks"]
        extra = {"tier_recovery_s": round(tier.recovery_seconds, 2)}
        store.close(flush=False)
    seconds = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)
    return {
        "what": what,
        "impl": impl,
        "policy": policy if what == "blockstore" else "",
        "blocks": blocks,
        "seconds": round(seconds, 2),
        "peak_rss_mb": _peak_rss() >> 20,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200k blocks")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.json")
    parser.add_argument("--blocks", type=int, default=0, help="blocks in the log (default 10M, 200k with --quick)")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the log (default: a temp dir)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the BlockStore of c9edcad")
    parser.add_argument("--no-store", action="store_true", help="time the tier's recover_log only")
    parser.add_argument("--policies", default="freq,lru", help="eviction policies of the BlockStore cases")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return 0
    blocks = args.blocks or (200_000 if args.quick else 10_000_000)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        t0 = time.perf_counter()
        build(root / "log", blocks)
        print(f"built a log of {blocks} blocks in {time.perf_counter() - t0:.1f} s", flush=True)
        cases = [("recover_log", "compact", "")]
        for policy in [] if args.no_store else args.policies.split(","):
            cases.append(("blockstore", "compact", policy))
            if not args.no_baseline:
                cases.append(("blockstore", "base", policy))
        rows: list[Row] = []
        for what, impl, policy in cases:
            case = {"dir": str(root / "log"), "what": what, "impl": impl, "policy": policy}
            cmd = [sys.executable, "-m", "bench.nvme_recovery", "--child", json.dumps(case)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-2000:])
                rows.append({"what": what, "impl": impl, "failed": out.stderr[-300:]})
                continue
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {rows[-1]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {r["policy"]: r for r in rows if r.get("impl") == "base" and "seconds" in r}
    for r in rows:
        b = base.get(r.get("policy", ""))
        if b is not None and r.get("what") == "blockstore" and r.get("impl") == "compact" and "seconds" in r:
            r["vs_base"] = round(r["seconds"] / b["seconds"], 2)
    report(
        rows,
        args,
        title=f"NVMe recovery of {blocks} blocks (checkpoint + summaries + scanned tail)",
        bench="nvme_recovery",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
