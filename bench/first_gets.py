"""What a fresh client's first Gets from NVMe cost, and what ``NodeClient.warm_up`` takes off them.

    python -m bench.first_gets [--quick] [--out bench/results/first_gets.json] [--block BYTES] [--count N]
                               [--processes N] [--dir DIR]

A worker that starts (a decode worker scaled out, a vLLM engine restarted) meets its store with a new process:
its first Gets used to compile the client's kernels, start the NVMe reader's threads and fault their memory
while they ran. Three ``kvstore serve`` processes, each with a write-through NVMe tier and no promotion (so every
Get below reads NVMe): one with ``--share-nvme`` (lane ``shm-disk``: the client reads the segment files itself),
one read by the store on the shm lane (``shm``) and on the TCP lane (``tcp``). Each is given prefixes of ``--count``
blocks of ``--block`` bytes (default 49 x 720 KiB: a SmolLM2 prompt's KV in ``bench.ttft``), more than its DRAM
holds, so that they are only on NVMe. Then, in turn, for each lane and each way of starting:

- ``connect``: a fresh process (``python -m bench.first_gets --child ...``) makes a ``Client``, calls
  ``connect()`` (the lane opened ahead, as every worker did before ``warm_up`` existed), and takes ``GETS`` Gets of
  distinct prefixes into page-aligned buffers, each timed;
- ``warm_up``: the same with ``warm_up()`` in place of ``connect()``.

Rows (one per lane and way; p50 over the processes): ``start_ms`` (what ``connect()`` or ``warm_up()`` took),
``get1_ms``, ``get2_ms``, ``get3_ms`` (the first three Gets), ``later_ms`` (the Gets after them), ``warm_ms`` (the
baseline, measured in the same run: the lane's ``later_ms`` after ``warm_up``), ``get1_vs_warm`` (the first
Get's time over it: 1 is as fast as a warm client) and ``lane_nvme_hits`` (the lane's store's NVMe hits over the
run, both ways: every block of every Get).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import child_row, parse_args, positive, report

LANES = ("shm-disk", "shm", "tcp")
STARTS = ("connect", "warm_up")
GETS = 8  # per process: the first three, then five later ones


def _store_args(lane: str, root: Path, dram: int) -> tuple[str, ...]:
    return (
        "--dram", f"{dram >> 20}MiB", "--nvme-dir", str(root / "nvme"), "--nvme", "16GiB",
        "--write-policy", "write-through", "--promote-on-hit", "false", "--shm-direct", "true",
        "--share-nvme", "true" if lane == "shm-disk" else "false",
    )  # fmt: skip


def child(target: str, lane: str, start: str, keys_file: str, block: int) -> None:
    """One fresh client process: ``start`` (connect or warm_up), then a Get of each prefix of ``keys_file``; prints
    one JSON line: the start's and each Get's milliseconds."""
    from kvstore.client import Client
    from kvstore.hugepages import huge_buffer

    prefixes = [[bytes.fromhex(k) for k in p] for p in json.loads(Path(keys_file).read_text())]
    count = len(prefixes[0])
    memory = huge_buffer(count * block)
    memory[:] = 0  # the worker's KV pool is made at start too
    out = [memory[i * block : (i + 1) * block] for i in range(count)]
    with Client(target, timeout=120, lane=lane.split("-")[0]) as kv:
        t0 = time.perf_counter()
        kind = kv.warm_up() if start == "warm_up" else kv.connect()
        started = time.perf_counter() - t0
        if kind != lane.split("-")[0]:
            raise SystemExit(f"asked for the {lane} lane, got {kind}")
        gets = []
        for keys in prefixes:
            t0 = time.perf_counter()
            kv.get("bench", keys, out=out)
            gets.append(time.perf_counter() - t0)
    print(json.dumps({"start_ms": started * 1e3, "gets_ms": [g * 1e3 for g in gets]}))


def measure(block: int, count: int, processes: int, root: Path, bar: tqdm) -> list[dict[str, Any]]:
    from kvstore.client import Client
    from kvstore.server.process import store_process

    rng = np.random.default_rng(5)
    payloads = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(8)]
    dram = 32 << 20
    per_store = processes * len(STARTS) * GETS  # every Get of the run reads a prefix of its own
    seen: dict[tuple[str, str], list[dict[str, Any]]] = {(lane, start): [] for lane in LANES for start in STARTS}
    with contextlib.ExitStack() as stack:
        targets, keys = {}, {}
        for lane in LANES:
            target, _ = stack.enter_context(store_process(*_store_args(lane, root / lane, dram)))
            targets[lane] = target
            with Client(target, timeout=120) as kv:
                prefixes = []
                for p in range(per_store + -(-dram // (count * block)) + 1):  # the last ones push the rest out
                    ks = [rng.bytes(16) for _ in range(count)]
                    if not all(
                        r.ok for r in kv.put("bench", ks, [payloads[(p + i) % 8] for i in range(count)], chained=False)
                    ):
                        raise RuntimeError(f"the {lane} store refused a prefix")
                    prefixes.append([k.hex() for k in ks])
            keys[lane] = prefixes[:per_store]
        taken = {lane: 0 for lane in LANES}
        for r in range(processes):
            cases = [(lane, start) for lane in LANES for start in STARTS]
            k = r % len(cases)
            for lane, start in cases[k:] + cases[:k]:  # a rotating order: each way meets the host alike
                keys_file = root / f"keys-{lane}-{start}-{r}.json"
                keys_file.write_text(json.dumps(keys[lane][taken[lane] : taken[lane] + GETS]))
                taken[lane] += GETS
                seen[(lane, start)].append(
                    child_row("first_gets", targets[lane], lane, start, str(keys_file), str(block))
                )
                bar.update(1)
        hits = {}
        for lane in LANES:  # every Get above read NVMe: the stores' own count
            with Client(targets[lane], timeout=120, lane="grpc") as kv:
                hits[lane] = {t["name"]: t["hits"] for t in kv.stats()["tiers"]}.get("nvme", 0)
    p50 = statistics.median
    warm = {lane: p50([g for run in seen[(lane, "warm_up")] for g in run["gets_ms"][3:]]) for lane in LANES}
    rows = []
    for (lane, start), runs in seen.items():
        row: dict[str, Any] = {"lane": lane, "start": start, "block_bytes": block, "blocks": count}
        row["processes"] = len(runs)
        row["start_ms"] = p50(run["start_ms"] for run in runs)
        for i in range(3):
            row[f"get{i + 1}_ms"] = p50(run["gets_ms"][i] for run in runs)
        row["later_ms"] = p50([g for run in runs for g in run["gets_ms"][3:]])
        row["warm_ms"] = warm[lane]
        row["lane_nvme_hits"] = hits[lane]
        row["get1_vs_warm"] = row["get1_ms"] / warm[lane]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        target, lane, start, keys_file, block = argv[1:6]
        child(target, lane, start, keys_file, int(block))
        return

    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--block", type=positive(int), default=737280, help="block bytes (default 720 KiB)")
        p.add_argument("--count", type=positive(int), default=49, help="blocks a prefix (default 49)")
        p.add_argument(
            "--processes",
            type=positive(int),
            default=None,
            help="fresh clients per lane and way (default 5; --quick 2)",
        )
        p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the stores keep their NVMe tiers")

    args = parse_args("a fresh client's first Gets from NVMe: connect() against warm_up()", argv, configure)
    processes = args.processes or (2 if args.quick else 5)
    root = Path(tempfile.mkdtemp(prefix="kvstore-first-gets-", dir=args.dir))
    try:
        with tqdm(total=processes * len(LANES) * len(STARTS), desc="fresh clients", unit="process") as bar:
            rows = measure(args.block, args.count, processes, root, bar)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(rows, args, title="a fresh client's first Gets from NVMe, ms (p50 over processes)", bench="first_gets")


if __name__ == "__main__":
    main()
