"""bench.replay: prefix hit rate against capacity on a Mooncake trace, the store's policy beside LRU and Belady.

    python -m bench.replay [--trace FILE] [--capacities 0.02,0.05,0.1,0.2,0.5] [--quick]
                           [--out FILE.json] [--plot FILE.png (default: beside --out)]

What "capacity" means: ``capacity_frac`` x the trace's distinct blocks, in
blocks of 512 tokens; in bytes, blocks x 64 MiB (Llama-3-8B KV in bf16). The
headline comparison is a single tier of that capacity (a DRAM tier of the
real ``BlockStore`` on byte-accounting tiers) against plain block LRU and
Belady's offline optimum of the same number of blocks. A block is a hit only
while every earlier block of its request hit (bench/replay_sim.py).

Also measured, same trace and capacity: ``popularity-oracle``, a cache that
knows how often each block will be used in the whole trace and evicts the
least popular (offline; the best any frequency-ranking policy could do),
``lifetime-oracle``, which also knows when each block is first and last used
and ranks by its rate of use while alive (offline; all but the timing of each
return), the
store with its base policy
(``leaf-lru``: the leaf rule alone) and with an admission filter (``admit2``:
a block is stored only from its second sighting on, as NVIDIA's KV block
manager does); and a two-tier store, DRAM = capacity and NVMe =
``--nvme-multiple`` x capacity below it, with the hit rate per tier (each hit
counted in the highest tier holding the block) and the bytes moved, also
with the store's NVMe admission filter (``freq+nvme-admit2``: a DRAM victim
is demoted only once used twice, else dropped; ``--nvme-admit-uses 2``).

JSON (``--out``): ``rows`` hold ``{"capacity_frac", "policy" ("kvstore",
"lru", "belady"), "hit_rate", ...}`` (DESIGN 2.4); ``variants``, ``tiers``
and ``trace`` hold the rest.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import Row, format_table, parse_args, plot_path, write_json
from bench.replay_sim import (
    LLAMA3_8B_BF16,
    ReplayResult,
    StoreSetup,
    Trace,
    belady_hit_rate,
    block_keys,
    lifetime_oracle_hit_rate,
    load_trace,
    lru_hit_rate,
    popularity_oracle_hit_rate,
    replay_store,
)
from kvstore.store.policies import DEFAULT_POLICY
from kvstore.tiers.base import DRAM, NVME

_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = (
    next((p for p in (_ROOT / "shared", _ROOT.parent / "shared") if p.is_dir()), _ROOT.parent / "shared")
    / "traces"
    / "synthetic_trace.jsonl"
)
FULL_CAPACITIES = (0.02, 0.05, 0.1, 0.2, 0.5)
QUICK_CAPACITIES = (0.05, 0.1)
QUICK_REQUESTS = 2000
GIB = 1 << 30
NVME_ADMIT2 = f"{DEFAULT_POLICY}+nvme-admit2"  # the two-tier store demoting only blocks used twice


@dataclass(frozen=True)
class Job:
    """One store replay: which table it feeds, its label and its setup."""

    kind: str  # "headline", "variant" or "tiers"
    label: str
    capacity_frac: float
    setup: StoreSetup


def plan(trace: Trace, capacities: Sequence[float], nvme_multiple: float) -> list[Job]:
    jobs: list[Job] = []
    for frac in capacities:
        blocks = trace.blocks_for(frac)
        jobs += [
            Job("headline", "kvstore", frac, StoreSetup(DEFAULT_POLICY, blocks)),
            Job("variant", "leaf-lru", frac, StoreSetup("lru", blocks)),
            Job("variant", "admit2", frac, StoreSetup("lru", blocks, admit_after=2)),
        ]
        nvme = max(1, int(blocks * nvme_multiple))
        jobs += [Job("tiers", name, frac, StoreSetup(name, blocks, nvme)) for name in (DEFAULT_POLICY, "lru")]
        jobs.append(Job("tiers", NVME_ADMIT2, frac, StoreSetup(DEFAULT_POLICY, blocks, nvme, nvme_admit_uses=2)))
    return jobs


# -- running the jobs in worker processes, with one progress bar ----------------------------
_progress: Any = None
_trace: Trace | None = None
_keys: dict[int, bytes] | None = None


def _init_worker(progress: Any, trace: Trace) -> None:
    global _progress, _trace, _keys
    _progress, _trace, _keys = progress, trace, block_keys(trace)


def _run_job(job: Job) -> tuple[Job, ReplayResult]:
    assert _trace is not None
    last = 0

    def tick(done: int) -> None:
        nonlocal last
        with _progress.get_lock():
            _progress.value += done - last
        last = done

    return job, replay_store(_trace, job.setup, _keys, progress=tick)


def run_jobs(trace: Trace, jobs: list[Job], workers: int) -> list[tuple[Job, ReplayResult]]:
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    progress = ctx.Value("q", 0)
    total = len(jobs) * len(trace.requests)
    results: list[tuple[Job, ReplayResult]] = []
    with (
        ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(progress, trace)) as pool,
        tqdm(total=total, unit="req", desc=f"replaying {len(jobs)} store runs", smoothing=0.1) as bar,
    ):
        pending = {pool.submit(_run_job, job) for job in jobs}
        while pending:
            done, pending = wait(pending, timeout=0.5)
            results += [f.result() for f in done]
            bar.update(progress.value - bar.n)
    return results


# -- tables -------------------------------------------------------------------------------
def gap_closed(kvstore: float, lru: float, belady: float) -> float:
    """Fraction of the LRU -> Belady gap that kvstore closes (1: reaches Belady; < 0: worse than LRU)."""
    return (kvstore - lru) / (belady - lru) if belady > lru else float("nan")


def build_tables(
    trace: Trace, capacities: Sequence[float], results: list[tuple[Job, ReplayResult]], block_bytes: int
) -> tuple[list[Row], list[Row], list[Row], list[Row]]:
    by = {(j.kind, j.label, j.capacity_frac): r for j, r in results}
    rows: list[Row] = []
    summary: list[Row] = []
    variants: list[Row] = []
    tiers: list[Row] = []
    for frac in capacities:
        blocks = trace.blocks_for(frac)
        lru = lru_hit_rate(trace.requests, blocks)
        belady = belady_hit_rate(trace.requests, blocks)
        store = by[("headline", "kvstore", frac)]
        common = {"capacity_frac": frac, "capacity_blocks": blocks, "capacity_bytes": blocks * block_bytes}
        gap = gap_closed(store.hit_rate, lru, belady)
        rows += [
            {
                **common,
                "policy": "kvstore",
                "hit_rate": store.hit_rate,
                "eviction_policy": DEFAULT_POLICY,
                "gap_to_belady": belady - store.hit_rate,
                "gap_closed": gap,
                "seconds": round(store.seconds, 2),
                "index_bytes": store.index_bytes,
            },
            {**common, "policy": "lru", "hit_rate": lru},
            {**common, "policy": "belady", "hit_rate": belady},
        ]
        leaf, admit = by[("variant", "leaf-lru", frac)], by[("variant", "admit2", frac)]
        variants += [
            {**common, "policy": label, "hit_rate": r.hit_rate, "gap_closed": gap_closed(r.hit_rate, lru, belady)}
            for label, r in (("leaf-lru", leaf), ("admit2", admit))
        ]
        oracle = popularity_oracle_hit_rate(trace.requests, blocks)
        lifetime = lifetime_oracle_hit_rate(trace.requests, blocks)
        variants += [
            {**common, "policy": label, "hit_rate": rate, "gap_closed": gap_closed(rate, lru, belady)}
            for label, rate in (("popularity-oracle", oracle), ("lifetime-oracle", lifetime))
        ]
        summary.append(
            {
                "cap": frac,
                "blocks": blocks,
                "GiB": blocks * block_bytes / GIB,
                "lru": lru,
                "kvstore": store.hit_rate,
                "belady": belady,
                "to_belady": belady - store.hit_rate,
                "gap_closed": gap,
                "leaf-lru": leaf.hit_rate,
                "admit2": admit.hit_rate,
                "pop-oracle": oracle,
                "life-oracle": lifetime,
            }
        )
        for name in (DEFAULT_POLICY, "lru", NVME_ADMIT2):
            r = by[("tiers", name, frac)]
            tiers.append(
                {
                    "capacity_frac": frac,
                    "policy": name,
                    "dram_blocks": r.setup.dram_blocks,
                    "nvme_blocks": r.setup.nvme_blocks,
                    "dram_hit": r.tier_hit_rate(DRAM),
                    "nvme_hit": r.tier_hit_rate(NVME),
                    "hit_rate": r.hit_rate,
                    "put_GiB": r.bytes_put / GIB,
                    "demoted_GiB": r.bytes_demoted / GIB,
                    "promoted_GiB": r.bytes_promoted / GIB,
                    "nvme_read_GiB": r.hits_by_rank[NVME] * block_bytes / GIB,
                }
            )
    return rows, summary, variants, tiers


# -- output --------------------------------------------------------------------------------
def plot(path: Path, summary: list[Row], tiers: list[Row], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    caps = [s["cap"] for s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, style in (
        ("belady", "k-"),
        ("life-oracle", "k--"),
        ("pop-oracle", "k:"),
        ("kvstore", "C0-o"),
        ("lru", "C3-s"),
        ("leaf-lru", "C2:"),
        ("admit2", "C1:"),
    ):
        label = f"kvstore ({DEFAULT_POLICY})" if key == "kvstore" else key
        left.plot(caps, [s[key] for s in summary], style, label=label, lw=2 if style[-1] in "-os" else 1.2)
    left.set(
        xscale="log",
        xlabel="capacity (fraction of distinct blocks)",
        ylabel="prefix hit rate",
        title="one tier: policy vs LRU and Belady",
    )
    left.set_xticks(caps, [f"{c:g}" for c in caps])
    left.xaxis.set_minor_formatter(NullFormatter())
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    mine = [t for t in tiers if t["policy"] == DEFAULT_POLICY]
    x = range(len(mine))
    right.bar(x, [t["dram_hit"] for t in mine], label="DRAM hits")
    right.bar(x, [t["nvme_hit"] for t in mine], bottom=[t["dram_hit"] for t in mine], label="NVMe hits")
    right.set_xticks(list(x), [f"{t['capacity_frac']:g}" for t in mine])
    right.set(
        xlabel="DRAM capacity (fraction; NVMe below it)",
        ylabel="prefix hit rate",
        title=f"two tiers ({DEFAULT_POLICY}): hits per tier",
    )
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake FAST'25 JSONL trace")
    parser.add_argument(
        "--capacities",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=None,
        help="capacities as fractions of the trace's distinct blocks "
        f"(default {','.join(map(str, FULL_CAPACITIES))}; --quick: {','.join(map(str, QUICK_CAPACITIES))})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"replay only the first N requests (default all; --quick: {QUICK_REQUESTS})",
    )
    parser.add_argument("--nvme-multiple", type=float, default=4.0, help="NVMe tier size as a multiple of DRAM")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="write the figure here (default: beside --out)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args("Replay a KV-cache trace against the store's placement and eviction", argv, configure)
    capacities = args.capacities or (QUICK_CAPACITIES if args.quick else FULL_CAPACITIES)
    if any(not 0 < c <= 1 for c in capacities):
        raise SystemExit("--capacities must be fractions in (0, 1]")
    limit = args.requests or (QUICK_REQUESTS if args.quick else None)
    trace = load_trace(args.trace, limit)
    block_bytes = LLAMA3_8B_BF16.block_bytes()
    jobs = plan(trace, capacities, args.nvme_multiple)
    started = time.perf_counter()
    results = run_jobs(trace, jobs, max(1, min(args.jobs, len(jobs))))
    rows, summary, variants, tiers = build_tables(trace, capacities, results, block_bytes)
    head = (
        f"{args.trace.name}: {len(trace.requests)} requests, {trace.total_blocks} blocks, "
        f"{trace.distinct_blocks} distinct; {LLAMA3_8B_BF16.name}: {block_bytes >> 20} MiB per block"
    )
    print(head)
    print(
        f"\nPrefix hit rate, one tier of capacity = cap x distinct blocks "
        f"(kvstore = BlockStore with policy '{DEFAULT_POLICY}'):"
    )
    print(format_table(summary))
    print(f"\nTwo tiers: DRAM = cap x distinct blocks, NVMe = {args.nvme_multiple:g} x DRAM below it:")
    print(format_table(tiers))
    print(f"\n{len(jobs)} store runs in {time.perf_counter() - started:.0f} s")
    if args.out:
        write_json(args.out, rows, args, bench="replay")
        doc = json.loads(args.out.read_text())
        doc.update(
            trace={
                "path": str(args.trace),
                "requests": len(trace.requests),
                "total_blocks": trace.total_blocks,
                "distinct_blocks": trace.distinct_blocks,
                "block_bytes": block_bytes,
                "model": LLAMA3_8B_BF16.name,
            },
            capacity="capacity_frac x distinct blocks of the trace, one tier (rows, variants); "
            "tiers: DRAM of that size plus NVMe of nvme_multiple x it",
            nvme_multiple=args.nvme_multiple,
            variants=variants,
            tiers=tiers,
        )
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {len(rows)} rows to {args.out}")
    figure = plot_path(args.out, args.plot)
    if figure:
        plot(figure, summary, tiers, head)
        print(f"wrote {figure}")


if __name__ == "__main__":
    main()
