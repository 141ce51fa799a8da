"""What reading a block again costs after a ``--share-nvme`` client read it from NVMe itself.

    python -m bench.nvme_reread [--quick] [--out FILE.json] [--prefixes N] [--sizes 64KiB,512KiB,2MiB]

Such a client reads NVMe-only blocks straight out of the tier's segment files, so the store never has their
bytes: before the background promotions (kvstore/store/background_promotions.py) a block such clients read
stayed on NVMe however often they read it, with DRAM idle. For each block size and each way the client learns
where a block lies (``asked``: the store names it, ``--dram-index false``; ``nvme-index``: the store's index of its
NVMe-only blocks does, unasked, ``--share-dram false``: the default where the DRAM arena stays private;
``index``: with ``--share-dram true`` the DRAM index does, the default where ``auto`` shares it), two ``kvstore
serve --share-nvme --write-policy write-through`` processes of this tree: ``promote`` (the default,
``--promote-on-hit true``: the blocks a client read again are queued and promoted by the store's promoter thread
while DRAM has room under its high watermark) and ``stay`` (``--promote-on-hit false``: what every ``--share-nvme``
store did before the fifty-fifth session, the baseline, measured in the same run). Each writes ``--prefixes``
32-block prefixes, then pushes them out of DRAM with as many more and deletes those: the prefixes are only on NVMe, with DRAM room for
all. Then, prefix by prefix, the two stores in a rotating order, each Get into one page-aligned pool:

- ``first``: the prefix's first Get (from the files, on both);
- ``second``: a Get 0.1 s later, from the files on both (since the fifty-sixth session a block is promoted on
  its second read by a client, not its first: a scan costs the disk nothing more). Its end reaches the store at
  once (a TOUCH frame: the asked Get's release, or the index's hits of blocks read from the files), and on
  ``promote`` the store reads the blocks again;
- ``third``: a Get 0.4 s after that: from DRAM on ``promote`` once the promotion is done, from the files on
  ``stay``.

Rows: p50 ms of each Get per store, ``reread_speedup`` (``stay`` third / ``promote`` third), ``second_cost``
(``promote`` second / ``stay`` second: what the Get that sets a promotion off pays for it; the promotion ran
beside it until the fifty-sixth session), ``promoted_share`` (the
``promote`` store's blocks in DRAM at the end, of those read).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import parse_args, positive, report
from bench.nvme_get_worker import PREFIX, write_prefix
from kvstore.sizes import parse_size

MODES = ("asked", "nvme-index", "index")
STORES = ("promote", "stay")


def measure_size(block: int, mode: str, prefixes: int, bar: tqdm) -> dict[str, Any]:
    from kvstore.client import Client
    from kvstore.server.process import store_process
    from kvstore.tiers.nvme.io import aligned_buffer

    dram = max(2 * prefixes * PREFIX * block, 64 << 20)  # room for every prefix, twice
    rng = np.random.default_rng(block)
    payloads = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(8)]
    pool = aligned_buffer(PREFIX * block)
    pool[:] = 1
    out = [pool[k * block : (k + 1) * block] for k in range(PREFIX)]
    times: dict[str, dict[str, list[float]]] = {s: {"first": [], "second": [], "third": []} for s in STORES}
    with contextlib.ExitStack() as stack:
        clients, keys, pids = {}, {}, {}
        for store in STORES:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"nvme_reread_{store}_", dir="/var/tmp"))
            target, proc = stack.enter_context(
                store_process(
                    *("--dram", f"{dram >> 20}MiB", "--nvme-dir", root, "--nvme", f"{max(4 * dram, 2 << 30) >> 20}MiB"),
                    *("--write-policy", "write-through", "--shm-direct", "true", "--share-nvme", "true"),
                    *("--share-dram", "true" if mode == "index" else "false"),
                    *("--dram-index", "false" if mode == "asked" else "true"),
                    *("--promote-on-hit", "true" if store == "promote" else "false"),
                )
            )
            pids[store] = proc.pid
            kv = clients[store] = stack.enter_context(Client(target, timeout=120, lane="shm"))
            kv.warm_up()  # kernels compiled: a fresh client's first Gets have the store read (and promote) them
            keys[store] = [write_prefix(kv, payloads, p, rng) for p in range(prefixes)]
            pushers = [write_prefix(kv, payloads, p, rng) for p in range(dram // (PREFIX * block) + 1)]
            time.sleep(1.0)  # the demoter made room for the pushers: the prefixes are only on NVMe
            for pushed in pushers:
                kv.delete("bench", pushed)
            if any(t != "nvme" for p in keys[store] for t in kv.lookup_tiers("bench", p)[1]):
                raise RuntimeError(f"{store}: a prefix is still in DRAM after the pushers")
        for i in range(prefixes):
            for store in STORES if i % 2 == 0 else STORES[::-1]:
                kv = clients[store]
                for step, pause in (("first", 0.1), ("second", 0.4), ("third", 0.0)):
                    t = time.perf_counter()
                    kv.get("bench", keys[store][i], out=out)
                    times[store][step].append((time.perf_counter() - t) * 1e3)
                    time.sleep(pause)
            bar.update(1)
        tiers = [t for p in keys["promote"] for t in clients["promote"].lookup_tiers("bench", p)[1]]
    p50 = {s: {step: statistics.median(v) for step, v in steps.items()} for s, steps in times.items()}
    row: dict[str, Any] = {"block_kib": block >> 10, "mode": mode, "prefixes": prefixes}
    for store in STORES:
        for step in ("first", "second", "third"):
            row[f"{store}_{step}_ms"] = p50[store][step]
    row["reread_speedup"] = p50["stay"]["third"] / p50["promote"]["third"]
    row["second_cost"] = p50["promote"]["second"] / p50["stay"]["second"]
    row["promoted_share"] = tiers.count("dram") / len(tiers)
    return row


def main(argv: list[str] | None = None) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--prefixes", type=positive(int), default=None, help="32-block prefixes a store (default 12)")
        p.add_argument(
            "--sizes", default="64KiB,512KiB,2MiB", help="block sizes, a comma list (default 64KiB,512KiB,2MiB)"
        )

    args = parse_args(
        "a --share-nvme client's reread of NVMe blocks, promoted in the background or not", argv, configure
    )
    prefixes = args.prefixes or (4 if args.quick else 12)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    rows = []
    with tqdm(total=len(sizes) * len(MODES) * prefixes, desc="prefixes", unit="prefix") as bar:
        for block in sizes:
            for mode in MODES:
                rows.append(measure_size(block, mode, prefixes, bar))
    report(rows, args, title="a --share-nvme client's Gets of NVMe-only prefixes, p50 ms", bench="nvme_reread")


if __name__ == "__main__":
    main()
