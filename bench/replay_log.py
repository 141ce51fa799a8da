"""bench.replay_log: the NVMe tier as a log of segments on a trace: segment against block eviction.

    python -m bench.replay_log [--trace FILE] [--capacities 0.05,0.1,0.2] [--segment-blocks 16,64]
                               [--nvme-multiple 4] [--quick] [--out FILE.json]

The real ``BlockStore`` replays the trace (as ``bench.replay``'s two-tier runs: DRAM = capacity x the trace's
distinct blocks, NVMe = ``--nvme-multiple`` x DRAM below it, the default policy) with its NVMe tier an
``AccountingLogTier``: space comes back a segment at a time, as the real tier's does, so a full tier must drop
whole segments or have compaction copy what is left of one (``kvstore serve --nvme-eviction``). Both are
replayed at each capacity and segment size. ``bench.replay`` counts bytes only, so it sees neither.

Rows: ``capacity_frac``, ``segment_blocks``, ``eviction``, ``hit_rate`` (blocks hit of all requested, a block a
hit only while every earlier block of its request hit), ``nvme_hit_rate``, ``write_amplification`` (records
written to NVMe, compaction's copies included, per record the store wrote), ``nvme_written``, ``relocated``,
``demotions_refused`` (demotion batches the full tier found no room for: the store retries them later).
The baseline is ``block`` eviction in the same run.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import format_table, parse_args, positive, write_json
from bench.replay import DEFAULT_TRACE
from bench.replay_sim import StoreSetup, block_keys, load_trace, replay_store
from kvstore.store.policies import DEFAULT_POLICY
from kvstore.tiers.base import NVME

EVICTIONS = ("block", "segment")


class _Refused(logging.Filter):
    """Counts, and keeps off the console, the store's warnings of a demotion batch the full tier refused (one a
    batch: thousands a replay); every other record goes through."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("copy of"):
            self.n += 1
            return False
        return True


def configure(p: Any) -> None:
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--capacities", default="0.05,0.1,0.2", help="DRAM as fractions of the distinct blocks")
    p.add_argument(
        "--segment-blocks", default="16,64", help="blocks a segment holds (e.g. 64: 256 MiB of 4 MiB blocks)"
    )
    p.add_argument("--nvme-multiple", type=positive(float), default=4.0, help="NVMe tier size as a multiple of DRAM")


def main(argv: list[str] | None = None) -> int:
    args = parse_args("NVMe as a log: segment against block eviction on a trace", argv, configure)
    trace = load_trace(args.trace, 1500 if args.quick else None)
    capacities = [0.1] if args.quick else [float(x) for x in args.capacities.split(",")]
    segments = [16] if args.quick else [int(x) for x in args.segment_blocks.split(",")]
    keys = block_keys(trace)
    rows: list[dict[str, Any]] = []
    runs = [(frac, blocks, mode) for frac in capacities for blocks in segments for mode in EVICTIONS]
    refused = _Refused()
    logging.getLogger("kvstore.store.blockstore").addFilter(refused)  # Cascade's logger
    for frac, seg_blocks, mode in tqdm(runs, desc="replays", unit="replay"):
        dram = trace.blocks_for(frac)
        nvme = max(2 * seg_blocks, int(dram * args.nvme_multiple))
        setup = StoreSetup(DEFAULT_POLICY, dram, nvme, nvme_segment_blocks=seg_blocks, nvme_eviction=mode)
        refused.n = 0
        r = replay_store(trace, setup, keys)
        written = max(1, r.nvme_records_written)
        rows.append(
            {
                "capacity_frac": frac,
                "segment_blocks": seg_blocks,
                "eviction": mode,
                "hit_rate": round(r.hit_rate, 4),
                "nvme_hit_rate": round(r.tier_hit_rate(NVME), 4),
                "write_amplification": round((r.nvme_records_written + r.nvme_relocated) / written, 3),
                "nvme_written": r.nvme_records_written,
                "relocated": r.nvme_relocated,
                "demotions_refused": refused.n,  # batches the full tier took no room for (retried later)
                "seconds": round(r.seconds, 1),
            }
        )
    print(f"{args.trace.name}: DRAM = capacity x distinct blocks, NVMe = {args.nvme_multiple:g} x DRAM as a log")
    print(format_table(rows))
    if args.out:
        write_json(args.out, rows, args, bench="replay_log")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
