"""What opening a data lane costs a client, and the shared memory open shm lanes hold in the store.

    python -m bench.lane_open [--quick] [--out FILE.json] [--clients N] [--lanes N]

One ``kvstore serve --dram 512MiB`` (default ``--shm-lane-bytes``, 256 MiB). For each lane kind (``shm``, ``tcp``),
``--clients`` fresh clients in turn: a ``Lookup`` on the new channel first (``grpc_ms``, the baseline measured
beside it: the connection and one round trip, which every lane's opening also pays), then ``connect()``
(``connect_ms``: the OpenLane call, the region's mapping or the TCP hello); ``connect_vs_grpc`` is their ratio
(p50s). Then ``--lanes`` shm clients at once, each a direct Put and Get of 16 x 2 MiB: ``shm_mib_held`` is what
/dev/shm holds for them over what it held before (the store's lane regions), against ``lanes x --shm-lane-bytes``
(``region_mib_total``), what it held when each region was reserved whole at its opening (before 2026-12-07).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import parse_args, positive, report

LANE_BYTES = 256 << 20  # the store's default --shm-lane-bytes
KINDS = ("shm", "tcp")


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def measure(clients: int, lanes: int, bar: tqdm) -> list[dict[str, Any]]:
    from kvstore.client import Client
    from kvstore.server.process import store_process

    rows: list[dict[str, Any]] = []
    with store_process("--dram", "512MiB") as (target, _):
        for kind in KINDS:
            grpc_ms, connect_ms = [], []
            for _ in range(clients):
                with Client(target, lane=kind) as kv:
                    t0 = time.perf_counter()
                    kv.lookup("bench", [b"\0" * 16])
                    t1 = time.perf_counter()
                    if kv.connect() != kind:
                        raise RuntimeError(f"no {kind} lane opened")
                    t2 = time.perf_counter()
                grpc_ms.append((t1 - t0) * 1e3)
                connect_ms.append((t2 - t1) * 1e3)
                bar.update(1)
            rows.append(
                {
                    "lane": kind,
                    "clients": clients,
                    "connect_ms": statistics.median(connect_ms),
                    "grpc_ms": statistics.median(grpc_ms),
                    "connect_vs_grpc": statistics.median(connect_ms) / statistics.median(grpc_ms),
                }
            )
        time.sleep(0.5)  # the closed clients' lanes let go of their regions
        before = _shm_used()
        blocks = [np.full(2 << 20, i, dtype=np.uint8) for i in range(16)]
        opened = []
        try:
            for c in range(lanes):
                kv = Client(target, lane="shm")
                opened.append(kv)
                keys = [bytes([c, i]) * 8 for i in range(16)]
                if not all(r.ok for r in kv.put("bench", keys, blocks)):
                    raise RuntimeError("the store refused a Put")
                out = [np.empty(2 << 20, dtype=np.uint8) for _ in range(16)]
                kv.get("bench", keys, out=out)
                if not all((o == b).all() for o, b in zip(out, blocks)):
                    raise RuntimeError("a Get came back different")
                bar.update(1)
            held = _shm_used() - before
        finally:
            for kv in opened:
                kv.close()
        rows[0].update(lanes=lanes, shm_mib_held=held / 2**20, region_mib_total=lanes * LANE_BYTES / 2**20)
    return rows


def main(argv: list[str] | None = None) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--clients", type=positive(int), default=None, help="fresh clients per lane kind (default 12)")
        p.add_argument("--lanes", type=positive(int), default=8, help="shm lanes open at once (default 8)")

    args = parse_args("a lane's opening against a first gRPC call; shm lanes' memory", argv, configure)
    clients = args.clients or (4 if args.quick else 12)
    with tqdm(total=clients * len(KINDS) + args.lanes, desc="clients", unit="client") as bar:
        rows = measure(clients, args.lanes, bar)
    report(rows, args, title="opening a lane, ms (p50); shm lanes' memory, MiB", bench="lane_open")


if __name__ == "__main__":
    main()
