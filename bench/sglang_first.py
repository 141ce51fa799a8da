"""A fresh SGLang engine's first page moves through kvstore, with and without the backend's warm clients.

    python -m bench.sglang_first [--quick] [--out FILE.json] [--pages 16] [--processes N]

SGLang's cache controller moves pages on threads of its own (``backup_thread_func`` Puts, ``prefetch_io_aux_func``
Gets) and each gets its own client at its first call. Without warm clients that first call opens a lane (the store
reserves its 256 MiB region) and meets the kernels compiling. One ``kvstore serve --dram 1GiB`` holds ``--pages``
pages (SmolLM2-135M's page_first geometry, ``bench.sglang_hicache``); then, in a rotating order, fresh processes
(``python -m bench.sglang_first --child ...``) each build ``KVStoreHiCacheStorage`` with ``warm_clients`` 0 (the
backend as it was before 88732d5: nothing warmed) or 2 (the default), register their host pool (``start_ms``),
take one ``batch_set_v1`` of new pages on one thread (``put1_ms``) and ``GETS`` ``batch_get_v1`` of the stored
pages on another (``get1_ms``, ``get2_ms``, ``later_ms``: the Gets after the third). The baseline, in the same
run: ``warm_ms``, the warmed backend's ``later_ms``; ``get1_vs_warm`` is a first Get's time over it (p50 of
processes). Needs ``sglang`` importable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

import torch
from tqdm import tqdm

from bench.common import child_row, parse_args, positive, report
from bench.sglang_hicache import PAGE, PageFirstPool, backend_for

GETS = 8
WARM_CLIENTS = (0, 2)


def _keys(first: int, n: int) -> list[str]:
    return [f"{i:064x}" for i in range(first, first + n)]


def child(target: str, warm_clients: int, pages: int, run: int) -> None:
    import kvstore.integrations.sglang  # noqa: F401 - SGLang's modules load in seconds: not part of the start

    pool = PageFirstPool(2 * pages)
    backend_for(target, pool, warm_clients=0).clear()  # the imports behind it too
    began = time.perf_counter()
    backend = backend_for(target, pool, warm_clients=warm_clients)
    start_ms = (time.perf_counter() - began) * 1e3
    stored, fresh = _keys(1, pages), _keys(1_000_000 * (run + 1) + 1_000 * warm_clients, pages)
    moved: dict[str, Any] = {"gets_ms": []}

    def put() -> None:
        t0 = time.perf_counter()
        ok = backend.batch_set_v1(fresh, torch.arange(pages * PAGE, 2 * pages * PAGE))
        moved["put1_ms"] = (time.perf_counter() - t0) * 1e3
        moved["put_ok"] = all(ok)

    def get() -> None:
        for _ in range(GETS):
            t0 = time.perf_counter()
            ok = backend.batch_get_v1(stored, torch.arange(pages * PAGE))
            moved["gets_ms"].append((time.perf_counter() - t0) * 1e3)
            moved["get_ok"] = moved.get("get_ok", True) and all(ok)

    for fn in (put, get):  # SGLang's backup thread, then its prefetch thread: each its first call
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()
    backend.clear()
    if not (moved["put_ok"] and moved["get_ok"]):
        raise SystemExit(f"pages were lost: {moved}")
    print(json.dumps({"start_ms": start_ms, **moved}))


def measure(pages: int, processes: int, bar: tqdm) -> list[dict[str, Any]]:
    from kvstore.server.process import store_process

    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in WARM_CLIENTS}
    with store_process("--dram", "1GiB") as (target, _):
        source = PageFirstPool(pages)
        writer = backend_for(target, source, warm_clients=0)
        if not all(writer.batch_set_v1(_keys(1, pages), torch.arange(pages * PAGE))):
            raise RuntimeError("the store refused the pages")
        writer.clear()
        for r in range(processes):
            order = WARM_CLIENTS if r % 2 == 0 else WARM_CLIENTS[::-1]  # each way meets the host alike
            for warm_clients in order:
                runs[warm_clients].append(child_row("sglang_first", target, str(warm_clients), str(pages), str(r)))
                bar.update(1)
    p50 = statistics.median
    warm_ms = p50([g for run in runs[max(WARM_CLIENTS)] for g in run["gets_ms"][3:]])
    rows = []
    for warm_clients, seen in runs.items():
        rows.append(
            {
                "warm_clients": warm_clients,
                "pages": pages,
                "mb": round(pages * source.page(0).nbytes / 1e6, 1),
                "processes": len(seen),
                "start_ms": p50(run["start_ms"] for run in seen),
                "put1_ms": p50(run["put1_ms"] for run in seen),
                "get1_ms": p50(run["gets_ms"][0] for run in seen),
                "get2_ms": p50(run["gets_ms"][1] for run in seen),
                "later_ms": p50([g for run in seen for g in run["gets_ms"][3:]]),
                "warm_ms": warm_ms,
                "get1_vs_warm": p50(run["gets_ms"][0] / warm_ms for run in seen),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        target, warm_clients, pages, run = argv[1:5]
        child(target, int(warm_clients), int(pages), int(run))
        return

    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--pages", type=positive(int), default=16, help="pages a call moves (default 16)")
        p.add_argument(
            "--processes", type=positive(int), default=None, help="fresh engines per way (default 6; --quick 2)"
        )

    args = parse_args("a fresh SGLang engine's first page moves: warm_clients 0 against 2", argv, configure)
    processes = args.processes or (2 if args.quick else 6)
    with tqdm(total=processes * len(WARM_CLIENTS), desc="fresh engines", unit="process") as bar:
        rows = measure(args.pages, processes, bar)
    report(rows, args, title="a fresh SGLang engine's first page moves, ms (p50 over processes)", bench="sglang_first")


if __name__ == "__main__":
    main()
