"""Put and get throughput through the client, beside memcpy, raw loopback TCP and Redis.

    python -m bench.transfer [--quick] [--out bench/results/transfer.json]

For blocks of 64 KiB, 512 KiB and 2 MiB in batches of 64, one row per (op,
block size, lane): GB/s through kvstore.client.Client against a `kvstore
serve` process, and in the same run the same bytes through a raw loopback
socket between two processes, through Redis (redis-server, redis-py with
hiredis, pipelined SET/GET) and through numpy memcpy. Medians over repetitions.
Also the p50/p99 latency of a single 2 MiB block Get.

Lanes (``--lanes``, all three by default): ``grpc`` (the streaming RPCs),
``shm`` (shared memory, same host) and ``tcp`` (the bulk socket lane); each
row names its lane and, where the lane has them, the issue's targets and
whether each was met (``targets``, ``met``): shm at 2 MiB >= 0.5x memcpy; shm
at 512 KiB and 2 MiB >= 2x Redis; tcp at 512 KiB and 2 MiB >= 0.8x the raw
socket, >= Redis on put and >= 2x Redis on get.

Payloads (``--payload``): ``pool`` (default) puts the blocks as slices of
one buffer, as a prefill worker puts pages of its KV pool; ``separate`` puts
one ``bytes`` object per block. The shm lane's direct puts (the store reads
the client's memory with process_vm_readv) run at 10-11 GB/s from one
allocation and 6-7 GB/s from many separate ones on this kernel, so the
choice shows in its put rows (``huge``: the one buffer in huge pages); every row records it (``payload``). Each
repetition drops the previous Get's results before the next Get, as a worker
that loads them into its pool does; ``--hold-results`` keeps them (on the
shm lane, results past half the region are then copied out, not lent).

Scatter-gather blocks (``--cases segments``, in the default run too): a vLLM-shaped block as 30 per-layer
buffers of 48 KiB (``kvstore.client.Segments``), 64 blocks per call, on shm and tcp, beside the same bytes as
one contiguous block and beside gathering into a staging buffer before a contiguous put (scattering after
the get), as ratios (``bench/transfer_segments.py``). ``--cases segments --out
bench/results/transfer_segments.json`` is the committed run of those rows alone.

Destination memory (``--cases destination``, not in the default run): Gets of 64 x 720 KiB into memory never
written (a fresh KV pool), the same with its pages made first, memory in use, and a ``Client.shared_pool``
(``bench/transfer_destination.py``).

The raw socket baseline (``raw_socket_gbps``, the targets' baseline) repeats
one cache-resident buffer on each side; beside it, ``raw_socket_distinct_gbps``
and ``vs_raw_socket_distinct`` move the batch's bytes as a store does, from
distinct memory into distinct memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from tqdm import tqdm

from bench import transfer_destination, transfer_segments
from bench.baselines import memcpy_gbps, raw_socket_gbps, redis_gbps, redis_server
from kvstore.client import Client
from kvstore.hugepages import huge_buffer
from kvstore.server.process import store_process

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12 (collections.abc.Buffer's too)
    from typing_extensions import Buffer

SIZES = [64 << 10, 512 << 10, 2 << 20]
BATCH = 64


def measure_lane(
    target: str, lane: str, size: int, reps: int, payload: str = "pool", hold_results: bool = False
) -> tuple[float, float]:
    total = size * BATCH
    if payload in ("pool", "huge"):
        pool = huge_buffer(total) if payload == "huge" else np.empty(total, dtype=np.uint8)
        pool[:] = np.frombuffer(os.urandom(total), dtype=np.uint8)
        blocks: list[memoryview | bytes] = [
            memoryview(cast("Buffer", pool[i * size : (i + 1) * size])) for i in range(BATCH)
        ]
    else:
        blocks = [os.urandom(size) for _ in range(BATCH)]
    put_t, get_t = [], []
    with Client(target, timeout=120, lane=lane) as kv:
        for rep in range(reps + 1):  # first repetition warms up connections and pages
            keys = [os.urandom(16) for _ in range(BATCH)]
            start = time.perf_counter()
            results = kv.put("bench", keys, blocks)
            put_s = time.perf_counter() - start
            assert all(r.status == "stored" for r in results), results[0]
            start = time.perf_counter()
            got = kv.get("bench", keys)
            get_s = time.perf_counter() - start
            assert len(got) == BATCH and bytes(got[-1][:64]) == bytes(blocks[-1][:64])
            if not hold_results:
                del got
            kv.delete("bench", keys)
            if rep:
                put_t.append(put_s)
                get_t.append(get_s)
    return total / statistics.median(put_t) / 1e9, total / statistics.median(get_t) / 1e9


def target_of(lane: str, op: str, size: int, gbps: float, base: dict[str, float]) -> dict[str, object]:
    """The issue's targets for this row, if it has any: {"targets": {name: met}, "met": all met}."""
    checks: list[tuple[str, float]] = []
    if lane == "shm" and size == 2 << 20:
        checks.append(("0.5x memcpy", 0.5 * base["memcpy"]))
    if lane == "shm" and size >= 512 << 10:
        checks.append(("2x redis", 2 * base[f"redis_{op}"]))
    if lane == "tcp" and size >= 512 << 10:
        checks.append(("0.8x raw socket", 0.8 * base[f"raw_{op}"]))
        checks.append(("1x redis" if op == "put" else "2x redis", (1 if op == "put" else 2) * base[f"redis_{op}"]))
    if not checks:
        return {}
    targets = {name: gbps >= need for name, need in checks}
    return {"targets": targets, "met": all(targets.values())}


def get_latency(target: str, lane: str, n: int) -> tuple[float, float]:
    with Client(target, lane=lane) as kv:
        key = os.urandom(16)
        kv.put("lat", [key], [os.urandom(2 << 20)])
        samples = []
        for _ in range(n + 5):
            start = time.perf_counter()
            kv.get("lat", [key])
            samples.append(time.perf_counter() - start)
        samples = sorted(samples[5:])
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (same code path)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.json", help="write the rows as JSON here")
    parser.add_argument("--lanes", default="grpc,shm,tcp", help="comma-separated lanes to measure (grpc, shm, tcp)")
    parser.add_argument(
        "--payload",
        choices=["pool", "huge", "separate"],
        default="pool",
        help="blocks as slices of one buffer (a KV pool; huge: that buffer in huge pages) or one bytes object each",
    )
    parser.add_argument(
        "--hold-results", action="store_true", help="keep each Get's results until the next Get returns"
    )
    parser.add_argument(
        "--cases",
        default="blocks,segments",
        help="comma-separated: blocks (contiguous blocks beside memcpy, raw sockets, Redis), segments "
        "(30-segment vLLM-shaped blocks beside contiguous and gathered ones, shm and tcp lanes), destination "
        "(Gets into fresh, populated, reused and shared-pool memory, shm and tcp lanes; not in the default run)",
    )
    args = parser.parse_args(argv)
    reps = 3 if args.quick else 7
    lanes = args.lanes.split(",")
    cases = args.cases.split(",")
    if not lanes or set(lanes) - {"grpc", "shm", "tcp"} or set(cases) - {"blocks", "segments", "destination"}:
        parser.error("--lanes: a comma list of grpc, shm, tcp; --cases: of blocks, segments, destination")
    rows = []
    if "segments" in cases:
        with store_process("--dram", "1GiB") as (target, _):
            segment_rows = transfer_segments.measure(target, [x for x in lanes if x in ("shm", "tcp")], reps)
        transfer_segments.print_rows(segment_rows)
        rows.extend(segment_rows)
    if "destination" in cases:
        with store_process("--dram", "1GiB") as (target, _):
            destination_rows = transfer_destination.measure(target, [x for x in lanes if x in ("shm", "tcp")], reps)
        transfer_destination.print_rows(destination_rows)
        rows.extend(destination_rows)
    if "blocks" in cases:
        rows.extend(block_rows(args, lanes, reps))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def block_rows(args: argparse.Namespace, lanes: list[str], reps: int) -> list[dict[str, object]]:
    """The contiguous-block rows: each lane beside memcpy, raw loopback sockets and Redis, and Get latency."""
    rows: list[dict[str, Any]] = []
    with store_process("--dram", "1GiB") as (target, _), redis_server() as redis_port:
        cases = [(size, lane) for size in SIZES for lane in lanes]
        baseline_cache: dict[int, dict[str, float]] = {}
        for size, lane in tqdm(cases, desc="transfer", unit="case"):
            total = size * BATCH
            if size not in baseline_cache:
                blocks = [os.urandom(size) for _ in range(BATCH)]
                keys = [os.urandom(16) for _ in range(BATCH)]
                r_put, r_get = redis_gbps(redis_port, keys, blocks, reps)
                baseline_cache[size] = {
                    "memcpy": memcpy_gbps(total),
                    "raw_put": raw_socket_gbps(total, "put", reps),
                    "raw_get": raw_socket_gbps(total, "get", reps),
                    "redis_put": r_put,
                    "redis_get": r_get,
                    "rawd_put": raw_socket_gbps(total, "put", reps, distinct=True),
                    "rawd_get": raw_socket_gbps(total, "get", reps, distinct=True),
                }
            base = baseline_cache[size]
            put, get = measure_lane(target, lane, size, reps, args.payload, args.hold_results)
            for op, gbps in (("put", put), ("get", get)):
                rows.append(
                    {
                        "op": op,
                        "lane": lane,
                        "block_bytes": size,
                        "batch": BATCH,
                        "gbps": round(gbps, 3),
                        "payload": args.payload,
                        "hold_results": args.hold_results,
                        "raw_socket_gbps": round(base[f"raw_{op}"], 3),
                        "redis_gbps": round(base[f"redis_{op}"], 3),
                        "memcpy_gbps": round(base["memcpy"], 3),
                        "vs_redis": round(gbps / base[f"redis_{op}"], 2),
                        "vs_raw_socket": round(gbps / base[f"raw_{op}"], 2),
                        "raw_socket_distinct_gbps": round(base[f"rawd_{op}"], 3),
                        "vs_raw_socket_distinct": round(gbps / base[f"rawd_{op}"], 2),
                        "vs_memcpy": round(gbps / base["memcpy"], 3),
                        **target_of(lane, op, size, gbps, base),
                    }
                )
        latency = {lane: get_latency(target, lane, 20 if args.quick else 100) for lane in lanes}
    print(
        f"\n{'op':4} {'lane':5} {'block':>8} {'GB/s':>7} {'raw sock':>8} {'redis':>7} {'memcpy':>7} {'/redis':>7}"
        f" {'/raw':>6} {'/rawd':>6} {'/memcpy':>7}  target"
    )
    for r in rows:
        met = ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in r.get("targets", {}).items())
        print(
            f"{r['op']:4} {r['lane']:5} {r['block_bytes'] >> 10:>6}Ki {r['gbps']:>7.3f} "
            f"{r['raw_socket_gbps']:>8.3f} {r['redis_gbps']:>7.3f} {r['memcpy_gbps']:>7.2f} {r['vs_redis']:>7.2f} "
            f"{r['vs_raw_socket']:>6.2f} {r['vs_raw_socket_distinct']:>6.2f} {r['vs_memcpy']:>7.3f}  {met}"
        )
    for lane, (p50, p99) in latency.items():
        print(f"single 2 MiB Get on {lane}: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
        rows.append(
            {"op": "get_latency_2mib", "lane": lane, "p50_ms": round(p50 * 1e3, 3), "p99_ms": round(p99 * 1e3, 3)}
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
