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
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import Row, format_table, parse_args, plot_path, positive, write_json
from bench.replay_hints import HINT_KINDS
from bench.replay_report import check_target, plot_suite, policy_rows
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
from bench.tracegen import KINDS, generate, write_trace
from kvstore.store.policies import DEFAULT_POLICY
from kvstore.tiers.base import DRAM, NVME

_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = (
    next((p for p in (_ROOT / "shared", _ROOT.parent / "shared") if p.is_dir()), _ROOT.parent / "shared")
    / "traces"
    / "synthetic_trace.jsonl"
)
FULL_CAPACITIES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
QUICK_CAPACITIES = (0.05, 0.1)
QUICK_REQUESTS = 2000
GIB = 1 << 30
NVME_ADMIT2 = f"{DEFAULT_POLICY}+nvme-admit2"  # the two-tier store demoting only blocks used twice
COMPARED = ("freq", "adaptive")  # policies replayed beside the default on every trace
HINT_CAPACITIES = (0.05, 0.1)  # where the hinted runs go (``--hint-capacities``)
GEN_REQUESTS, QUICK_GEN_REQUESTS = 4000, 1500


@dataclass(frozen=True)
class Job:
    """One store replay: which table it feeds, its label and its setup."""

    kind: str  # "headline", "variant" or "tiers"
    label: str
    capacity_frac: float
    setup: StoreSetup


def plan(
    trace: Trace,
    capacities: Sequence[float],
    nvme_multiple: float,
    tiers: bool = True,
    hint_capacities: Sequence[float] = HINT_CAPACITIES,
) -> list[Job]:
    jobs: list[Job] = []
    for frac in capacities:
        blocks = trace.blocks_for(frac)
        jobs += [
            Job("headline", "kvstore", frac, StoreSetup(DEFAULT_POLICY, blocks)),
            Job("variant", "leaf-lru", frac, StoreSetup("lru", blocks)),
            Job("variant", "admit2", frac, StoreSetup("lru", blocks, admit_after=2)),
        ]
        jobs += [Job("policy", name, frac, StoreSetup(name, blocks)) for name in COMPARED if name != DEFAULT_POLICY]
        if any(abs(frac - c) < 1e-9 for c in hint_capacities):
            jobs += [
                Job("hints", f"adaptive+{kind}", frac, StoreSetup("adaptive", blocks, hints=kind))
                for kind in HINT_KINDS
            ]
        if not tiers:
            continue
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
            if ("tiers", name, frac) not in by:
                continue
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


# -- output: tables and the figure are in bench/replay_report.py -------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake FAST'25 JSONL trace")
    parser.add_argument(
        "--traces",
        type=lambda s: [Path(x) for x in s.split(",") if x],
        default=[],
        metavar="FILE,FILE",
        help="more traces to replay after --trace (each gets its own table; rows carry a 'trace' field)",
    )
    parser.add_argument(
        "--generated",
        type=lambda s: list(KINDS) if s == "all" else s.split(","),
        default=[],
        metavar="KIND,KIND|all",
        help=f"also replay traces made by bench.tracegen ({', '.join(KINDS)})",
    )
    parser.add_argument("--gen-seed", type=int, default=1, help="seed of the generated traces")
    parser.add_argument(
        "--gen-requests",
        type=int,
        default=None,
        help=f"requests per generated trace (default {GEN_REQUESTS}; --quick: {QUICK_GEN_REQUESTS})",
    )
    parser.add_argument(
        "--capacities",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=None,
        help="capacities as fractions of the trace's distinct blocks "
        f"(default {','.join(map(str, FULL_CAPACITIES))}; --quick: {','.join(map(str, QUICK_CAPACITIES))})",
    )
    parser.add_argument(
        "--hint-capacities",
        type=lambda s: tuple(float(x) for x in s.split(",") if x),
        default=HINT_CAPACITIES,
        help="capacities at which the adaptive policy is also replayed with future-derived hints "
        f"(default {','.join(map(str, HINT_CAPACITIES))}; empty: none)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"replay only the first N requests (default all; --quick: {QUICK_REQUESTS})",
    )
    parser.add_argument(
        "--nvme-multiple", type=positive(float), default=4.0, help="NVMe tier size as a multiple of DRAM"
    )
    parser.add_argument("--jobs", type=positive(int), default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png", help="write the figure here (default: beside --out)"
    )


def _generated(kinds: Sequence[str], seed: int, requests: int, where: Path) -> list[Path]:
    paths = []
    for kind in kinds:
        path = where / f"{kind}-s{seed}-n{requests}.jsonl"
        write_trace(generate(kind, seed, requests), path)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args("Replay a KV-cache trace against the store's placement and eviction", argv, configure)
    capacities = args.capacities or (QUICK_CAPACITIES if args.quick else FULL_CAPACITIES)
    if any(not 0 < c <= 1 for c in capacities):
        raise SystemExit("--capacities must be fractions in (0, 1]")
    limit = args.requests or (QUICK_REQUESTS if args.quick else None)
    gen_requests = args.gen_requests or (QUICK_GEN_REQUESTS if args.quick else GEN_REQUESTS)
    block_bytes = LLAMA3_8B_BF16.block_bytes()
    started = time.perf_counter()
    all_rows: list[Row] = []
    doc_parts: dict[str, list[Row]] = {"variants": [], "tiers": [], "policies": [], "hints": []}
    traces_meta: list[Row] = []
    suite: list[tuple[str, list[Row], list[Row]]] = []
    runs = 0
    with tempfile.TemporaryDirectory(prefix="replay-traces-") as tmp:
        paths = [args.trace, *args.traces, *_generated(args.generated, args.gen_seed, gen_requests, Path(tmp))]
        for n, path in enumerate(paths):
            name = path.stem
            trace = load_trace(path, limit)
            jobs = plan(trace, capacities, args.nvme_multiple, tiers=n == 0, hint_capacities=args.hint_capacities)
            runs += len(jobs)
            results = run_jobs(trace, jobs, max(1, min(args.jobs, len(jobs))))
            rows, summary, variants, tiers = build_tables(trace, capacities, results, block_bytes)
            policies, hints = policy_rows(summary, results)
            head = (
                f"{name}: {len(trace.requests)} requests, {trace.total_blocks} blocks, "
                f"{trace.distinct_blocks} distinct; {LLAMA3_8B_BF16.name}: {block_bytes >> 20} MiB per block"
            )
            print(f"\n{head}")
            print(
                f"Prefix hit rate, one tier of capacity = cap x distinct blocks "
                f"(kvstore = BlockStore with policy '{DEFAULT_POLICY}'):"
            )
            print(format_table(policies))
            if hints:
                print("With hints derived from the future (adaptive policy); gap_closed = share of LRU -> Belady:")
                print(format_table(hints))
            if tiers:
                print(f"Two tiers: DRAM = cap x distinct blocks, NVMe = {args.nvme_multiple:g} x DRAM below it:")
                print(format_table(tiers))
            tag = {"trace": name}
            all_rows += [{**tag, **r} for r in rows]
            for key, part in (("variants", variants), ("tiers", tiers), ("policies", policies), ("hints", hints)):
                doc_parts[key] += [{**tag, **r} for r in part]
            traces_meta.append(
                {
                    "name": name,
                    "path": str(path) if n < 1 + len(args.traces) else f"bench.tracegen {path.stem}",
                    "requests": len(trace.requests),
                    "total_blocks": trace.total_blocks,
                    "distinct_blocks": trace.distinct_blocks,
                }
            )
            suite.append((name, policies, hints))
    target = check_target(suite)
    print(f"\nTarget: default >= max(lru, freq) - 0.005 at every capacity of every trace: {target['met']}")
    print(format_table(target["worst"]))
    print(f"\n{runs} store runs in {time.perf_counter() - started:.0f} s")
    if args.out:
        write_json(args.out, all_rows, args, bench="replay")
        doc = json.loads(args.out.read_text())
        doc.update(
            trace={**traces_meta[0], "block_bytes": block_bytes, "model": LLAMA3_8B_BF16.name},
            traces=traces_meta,
            capacity="capacity_frac x distinct blocks of the trace, one tier (rows, variants, policies, hints); "
            "tiers (first trace only): DRAM of that size plus NVMe of nvme_multiple x it",
            default_policy=DEFAULT_POLICY,
            nvme_multiple=args.nvme_multiple,
            target=target,
            **doc_parts,
        )
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {len(all_rows)} rows to {args.out}")
    figure = plot_path(args.out, args.plot)  # --plot, else beside --out, else none
    if figure:
        plot_suite(figure, suite, DEFAULT_POLICY)
        print(f"wrote {figure}")


if __name__ == "__main__":
    main()
