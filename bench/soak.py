"""Soak: mixed put/get/lookup from many clients at a fixed rate against a `kvstore serve` subprocess.

    python -m bench.soak [--minutes 10] [--quick] [--out FILE.json] [--plot FILE.png (default: beside --out)]
                         [--nvme SIZE [--nvme-segment SIZE] [--write-policy P] [--nvme-eviction E]]
                         [--share | --direct] [--hot S]

Each client is a thread with its own tenant token and namespace (a tenants file
is generated, so the interceptor, namespace checks and Stats scoping run under
load; the bytes move over the lane ``--lane`` picks, shared memory by default on one host)
and issues operations on a fixed schedule (``--rate`` in total): puts of
``--batch`` fresh random blocks, gets of recently acknowledged blocks (bytes
compared with what was put), lookups. The DRAM tier is smaller than what is
written, so eviction runs the whole time (``evictions``: copies dropped with
none left below them). Every ``--window`` seconds a row records throughput,
p50/p99 latency, errors and the server's RSS.

At the end, with the load stopped, every acknowledged block is read back:
each one still in the store must be byte-exact (``corrupt`` = 0), and every one
that is gone must be covered by the store's eviction count (``lost`` = 0). RSS
must stay flat after warm-up (growth < 5%). The process exits 1 if any check fails.

``--nvme SIZE`` gives the store an NVMe tier too (in small segments, ``--nvme-segment``), smaller than what is
written: DRAM demotes, NVMe evicts and compacts, and Gets read blocks back from disk while that goes on. With
``--share`` the store also shares its DRAM arena, its index and its NVMe files (``--share-dram``,
``--share-nvme``, ``--shm-direct``) and each client Gets into page-aligned buffers of its own, so that hits are
read by the clients themselves, from the mapped arena or the segment files, while the store moves and rewrites
them. With ``--direct`` (``--shm-direct`` alone) the clients Get into their own buffers too, but the store reads
every block and writes it into their memory: NVMe-only blocks are read by the tier's threads and handed on piece
by piece as each is verified (``kvstore/tiers/nvme/pipeline.py``), the path ``bench.nvme_get``'s ``nvme-shm``
measures; ``--batch 32`` gives it Gets of more pieces than the tier has reading threads. A block gone from
every tier counts among the evictions of some tier, so ``lost`` stays an upper bound.
"""

from __future__ import annotations

import json
import random
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.common import format_table, parse_args, plot_path, positive, write_json
from kvstore.client import Client, KVStoreError
from kvstore.server.process import store_process
from kvstore.sizes import parse_size
from kvstore.tiers.nvme.io import aligned_buffer

OPS = ("put", "get", "lookup")
TIER_COUNTS = ("blocks_written", "compactions", "relocated", "extents_lent", "corrupt")  # a lower tier's


def payload(key: bytes, size: int) -> bytes:
    """The bytes of a block, derived from its key (nothing to keep in memory for the final check)."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Window:
    """Operations finished in one reporting window."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: int = 0
    bytes_moved: int = 0
    get_hits: int = 0
    get_misses: int = 0
    corrupt: int = 0


class Recorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.window = Window()
        self.all_latencies: list[tuple[float, str, float]] = []  # (time, op, seconds)
        self.error_samples: list[str] = []

    def done(self, op: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.window.latencies[op].append(seconds)
            self.window.bytes_moved += nbytes
            self.all_latencies.append((time.monotonic(), op, seconds))

    def note(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                setattr(self.window, key, getattr(self.window, key) + value)

    def error(self, text: str) -> None:
        with self._lock:
            self.window.errors += 1
            if len(self.error_samples) < 10:
                self.error_samples.append(text)

    def cut(self) -> Window:
        with self._lock:
            window, self.window = self.window, Window()
            return window


@dataclass
class Worker:
    """One client: a tenant, a namespace and the blocks it got acknowledged."""

    index: int
    token: str
    namespace: str
    acked: list[bytes] = field(default_factory=list)
    lane: str = ""


def run_worker(w: Worker, target: str, args: Any, rec: Recorder, stop: threading.Event) -> None:
    rng = random.Random(w.index)
    popular = np.random.default_rng(w.index)
    interval = args.clients / args.rate
    block = args.block_kib << 10
    # --share, --direct: Gets land in page-aligned buffers of ours, which the DRAM index and the NVMe file reads
    # fill (--share) or the store writes (--direct)
    pool = aligned_buffer(args.batch * block) if args.share or args.direct else None
    outs = [pool[k * block : (k + 1) * block] for k in range(args.batch)] if pool is not None else None
    with Client(target, token=w.token, timeout=30, retries=2, lane=args.lane) as kv:
        next_at = time.monotonic() + rng.random() * interval
        while not stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            next_at += interval
            op = "put" if len(w.acked) < 8 else rng.choices(OPS, weights=(3, 5, 2))[0]
            recent = w.acked[-500:]
            start = time.perf_counter()
            try:
                if op == "put":
                    keys = [rng.randbytes(16) for _ in range(args.batch)]
                    results = kv.put(w.namespace, keys, [payload(k, block) for k in keys], chained=False)
                    w.acked.extend(k for k, r in zip(keys, results) if r.status in ("stored", "already_present"))
                    w.lane = kv.lane_kind
                    rec.done(op, time.perf_counter() - start, block * len(keys))
                elif op == "get":
                    keys = rng.sample(recent, min(args.batch, len(recent)))
                    if args.hot and rng.random() < 0.5:  # by popularity: the client's first blocks the most
                        ranks = popular.zipf(args.hot, 4 * args.batch) - 1
                        keys = list(dict.fromkeys(w.acked[r] for r in ranks if r < len(w.acked)))[: args.batch]
                    got = kv.get(w.namespace, keys, out=outs[: len(keys)] if outs else None, allow_missing=True)
                    rec.done(op, time.perf_counter() - start, sum(len(g) for g in got if g is not None))
                    hits = [(k, g) for k, g in zip(keys, got) if g is not None]
                    rec.note(
                        get_hits=len(hits),
                        get_misses=len(keys) - len(hits),
                        corrupt=sum(bytes(g) != payload(k, block) for k, g in hits),
                    )
                else:
                    kv.lookup(w.namespace, rng.sample(recent, min(8, len(recent))))
                    rec.done(op, time.perf_counter() - start)
            except KVStoreError as err:
                rec.error(f"{op}: {err}")


def verify(workers: list[Worker], target: str, block: int) -> dict[str, int]:
    """Read back every acknowledged block (load stopped): present ones must be byte-exact."""
    out = {"acked": 0, "present": 0, "missing": 0, "corrupt": 0}
    for w in workers:
        with Client(target, token=w.token, timeout=60) as kv:
            for i in range(0, len(w.acked), 256):
                keys = w.acked[i : i + 256]
                got = kv.get(w.namespace, keys, allow_missing=True)
                out["acked"] += len(keys)
                for k, g in zip(keys, got):
                    if g is None:
                        out["missing"] += 1
                    else:
                        out["present"] += 1
                        out["corrupt"] += bytes(g) != payload(k, block)
    return out


def store_options(args: Any, tmp: Path) -> list[str]:
    """``kvstore serve`` options for ``--nvme``, ``--share`` and ``--direct``."""
    options: list[str] = []
    if args.nvme:
        options += ["--nvme-dir", str(tmp / "nvme"), "--nvme", str(parse_size(args.nvme))]
        options += ["--nvme-segment", str(parse_size(args.nvme_segment)), "--write-policy", args.write_policy]
        options += ["--nvme-eviction", args.nvme_eviction] if args.nvme_eviction else []
    if args.share:
        options += ["--share-dram", "true", "--shm-direct", "true"] + (["--share-nvme", "true"] if args.nvme else [])
    elif args.direct:
        options += ["--shm-direct", "true"]
    return options


def dropped(stats: dict[str, Any]) -> int:
    """Copies evicted with none left below them (each tier's evictions less its demotions): every block gone
    from the store is one of these, so they bound the blocks a read-back may miss."""
    counters = stats.get("counters", {})
    return sum(int(t["evictions"]) - int(counters.get(f"tier_{t['name']}_demotions", 0)) for t in stats["tiers"])


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def window_row(t: float, window: Window, seconds: float, rss: int, stats: dict[str, Any]) -> dict[str, Any]:
    lat = [x for op in OPS for x in window.latencies[op]]
    return {
        "t_s": round(t, 1),
        "ops_per_s": round(len(lat) / seconds, 1),
        "MB_per_s": round(window.bytes_moved / seconds / 1e6, 2),
        "p50_ms": round(percentile(lat, 50), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        "put_p99_ms": round(percentile(window.latencies["put"], 99), 2),
        "get_p99_ms": round(percentile(window.latencies["get"], 99), 2),
        "errors": window.errors,
        "get_hits": window.get_hits,
        "get_misses": window.get_misses,
        "corrupt": window.corrupt,
        "rss_MiB": round(rss / 2**20, 1),
        "blocks": stats.get("blocks", 0),
        "evictions": dropped(stats),
        **{f"{t['name']}_hits": int(t["hits"]) for t in stats.get("tiers", [])},  # cumulative, per tier
    }


def plot(rows: list[dict[str, Any]], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for ax, key, label in zip(
        axes, ("ops_per_s", "p99_ms", "rss_MiB"), ("throughput (ops/s)", "p99 latency (ms)", "server RSS (MiB)")
    ):
        ax.plot(t, [r[key] for r in rows], marker=".")
        ax.axvline(warmup_s, color="grey", linestyle=":", label="end of warm-up")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)  # absolute scale: a flat line is flat, not a zoomed-in wiggle
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    axes[0].legend(loc="lower right")
    fig.suptitle("kvstore soak: mixed put/get/lookup at a fixed rate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def configure(p: Any) -> None:
    p.add_argument("--minutes", type=positive(float), default=10.0, help="duration (default 10; --quick: 0.75)")
    p.add_argument("--clients", type=positive(int), default=8, help="client threads, each its own tenant (default 8)")
    p.add_argument("--tenants", type=positive(int), default=4, help="tenants the clients are spread over (default 4)")
    p.add_argument(
        "--rate", type=positive(float), default=150.0, help="operations per second, all clients (default 150)"
    )
    p.add_argument("--batch", type=positive(int), default=4, help="blocks per put/get (default 4)")
    p.add_argument("--block-kib", type=positive(int), default=64, help="block size in KiB (default 64)")
    p.add_argument("--dram", default="96MiB", help="server DRAM tier (default 96MiB: eviction runs throughout)")
    p.add_argument(
        "--lane",
        default="auto",
        choices=["auto", "grpc", "shm", "tcp"],
        help="data lane of the clients (default auto: shm on the same host)",
    )
    p.add_argument(
        "--window", type=positive(float), default=10.0, help="seconds per reported row (default 10; --quick 3)"
    )
    p.add_argument(
        "--nvme",
        default=None,
        metavar="SIZE",
        help="also an NVMe tier of this size (default none; e.g. 256MiB: smaller than what is written, so it "
        "evicts and compacts under the load)",
    )
    p.add_argument(
        "--nvme-segment", default="16MiB", metavar="SIZE", help="NVMe segment size (default 16MiB: many to compact)"
    )
    p.add_argument(
        "--write-policy",
        default="write-back",
        choices=["write-back", "write-through"],
        help="with --nvme: when blocks reach NVMe (default write-back: on demotion)",
    )
    p.add_argument(
        "--nvme-eviction",
        default=None,
        choices=["segment", "block"],
        help="with --nvme: the store's --nvme-eviction (default: the store's own default, segment)",
    )
    serving = p.add_mutually_exclusive_group()  # how Gets land in the clients' own buffers, if they do
    serving.add_argument(
        "--share",
        action="store_true",
        help="serve with --share-dram, --share-nvme and --shm-direct, and Get into buffers of the clients' own: "
        "hits read by the clients from the mapped arena and the NVMe files (the shm lane)",
    )
    serving.add_argument(
        "--direct",
        action="store_true",
        help="serve with --shm-direct only, and Get into buffers of the clients' own that the store writes: every "
        "block read by the store, NVMe-only ones handed on piece by piece as verified (the shm lane)",
    )
    p.add_argument(
        "--hot",
        type=float,
        default=0.0,
        metavar="S",
        help="half of the Gets read by popularity: Zipf(S) ranks over all of a client's blocks, its first the "
        "most popular, as a shared system prompt is (default 0: every Get reads among the last 500 blocks)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="plot throughput, p99 and RSS (default: beside --out)",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args("Soak test: a store under steady mixed load for minutes", argv, configure)
    if args.quick:
        args.minutes, args.window = min(args.minutes, 0.75), min(args.window, 3.0)
    duration = args.minutes * 60
    warmup_s = max(10.0, 0.2 * duration)
    with tempfile.TemporaryDirectory(prefix="kvstore-soak-") as tmp:
        tenants = [
            {"name": f"t{i}", "token": secrets.token_hex(16), "namespaces": [f"soak-{i}/*"]}
            for i in range(args.tenants)
        ]
        admin = {"name": "soak-admin", "token": secrets.token_hex(16), "namespaces": [], "admin": True}
        (Path(tmp) / "tenants.yaml").write_text(yaml.safe_dump([*tenants, admin]))
        workers = [
            Worker(i, tenants[i % args.tenants]["token"], f"soak-{i % args.tenants}/c{i}") for i in range(args.clients)
        ]
        with store_process(
            "--dram",
            str(parse_size(args.dram)),
            "--tenants",
            str(Path(tmp) / "tenants.yaml"),
            "--workers",
            str(max(16, 2 * args.clients)),
            *store_options(args, Path(tmp)),
            timeout=120,
        ) as (target, proc):
            rec, stop = Recorder(), threading.Event()
            threads = [
                threading.Thread(target=run_worker, args=(w, target, args, rec, stop), daemon=True) for w in workers
            ]
            rows: list[dict[str, Any]] = []
            with Client(target, token=admin["token"], timeout=30) as probe:
                started = last = time.monotonic()
                for th in threads:
                    th.start()
                while (now := time.monotonic()) - started < duration:
                    time.sleep(max(0.0, min(last + args.window, started + duration) - now))
                    now = time.monotonic()
                    rows.append(window_row(now - started, rec.cut(), now - last, rss_bytes(proc.pid), probe.stats()))
                    r = rows[-1]
                    print(
                        f"t={r['t_s']:7.1f}s  {r['ops_per_s']:6.1f} ops/s  p99 {r['p99_ms']:7.2f} ms  "
                        f"errors {r['errors']}  rss {r['rss_MiB']:.1f} MiB  evictions {r['evictions']}",
                        flush=True,
                    )
                    last = now
                stop.set()
                for th in threads:
                    th.join(60)
                check: dict[str, Any] = dict(verify(workers, target, args.block_kib << 10))
                final = probe.stats()
            check["evictions"] = dropped(final)
            counters = final["counters"]
            for t in final["tiers"][1:]:
                check.update({f"{t['name']}_hits": t["hits"], f"{t['name']}_evictions": t["evictions"]})
                check.update({f"{t['name']}_{k}": int(counters.get(f"tier_{t['name']}_{k}", 0)) for k in TIER_COUNTS})
                written = check[f"{t['name']}_blocks_written"]
                if written:  # records the disk wrote per block the store wrote to it: compaction's copies too
                    moved = check[f"{t['name']}_relocated"]
                    check[f"{t['name']}_write_amplification"] = round((written + moved) / written, 2)
            check["lost"] = max(0, check["missing"] - check["evictions"])
            check["direct_get_bytes"] = int(counters.get("lane_shm_direct_get_bytes", 0))  # written into clients
            check["rss_end_MiB"] = round(rss_bytes(proc.pid) / 2**20, 1)
    check["lane"] = ",".join(sorted({w.lane for w in workers}))
    return report_soak(args, rows, rec, check, warmup_s, duration)


def summarize(
    rows: list[dict[str, Any]], rec: Recorder, check: dict[str, Any], warmup_s: float, duration: float
) -> dict[str, Any]:
    steady = [r for r in rows if r["t_s"] >= warmup_s] or rows[-1:]
    t0 = rec.all_latencies[0][0] if rec.all_latencies else 0.0
    after = [(op, s) for t, op, s in rec.all_latencies if t - t0 >= warmup_s]
    lat = [s for _, s in after]
    rss_warm, rss_end = steady[0]["rss_MiB"], steady[-1]["rss_MiB"]
    hits = sum(r["get_hits"] for r in steady)
    return {
        "duration_s": round(duration, 1),
        "warmup_s": round(warmup_s, 1),
        "ops": len(rec.all_latencies),
        "ops_per_s": round(sum(r["ops_per_s"] for r in steady) / len(steady), 1),
        "MB_per_s": round(sum(r["MB_per_s"] for r in steady) / len(steady), 2),
        "p50_ms": round(percentile(lat, 50), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        **{f"{op}_p99_ms": round(percentile([s for o, s in after if o == op], 99), 2) for op in OPS},
        "get_hit_rate": round(hits / max(1, hits + sum(r["get_misses"] for r in steady)), 4),  # blocks, after warm-up
        "errors": sum(r["errors"] for r in rows),
        "corrupt_during_run": sum(r["corrupt"] for r in rows),
        "rss_after_warmup_MiB": rss_warm,
        "rss_end_MiB": rss_end,
        "rss_max_after_warmup_MiB": max(r["rss_MiB"] for r in steady),
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
        **{f"final_{k}": v for k, v in check.items()},
    }


def report_soak(
    args: Any, rows: list[dict[str, Any]], rec: Recorder, check: dict[str, Any], warmup_s: float, duration: float
) -> int:
    summary = summarize(rows, rec, check, warmup_s, duration)
    print()
    print(format_table([{"figure": k, "value": v} for k, v in summary.items()]))
    for sample in rec.error_samples:
        print("error sample:", sample)
    failures = [
        name
        for name, bad in (
            ("corrupt blocks", summary["corrupt_during_run"] or summary["final_corrupt"]),
            ("lost blocks", summary["final_lost"]),
            ("RSS growth >= 5% after warm-up", summary["rss_growth_pct"] >= 5.0),
            ("no operations", not summary["ops"]),
        )
        if bad
    ]
    summary["passed"] = not failures
    if args.out:
        write_json(args.out, rows, args, bench="soak")
        doc = json.loads(args.out.read_text())
        doc["summary"] = summary
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {len(rows)} windows and the summary to {args.out}")
    figure = plot_path(args.out, args.plot)
    if figure:
        plot(rows, figure, warmup_s)
        print(f"wrote {figure}")
    print("PASSED" if not failures else "FAILED: " + ", ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
