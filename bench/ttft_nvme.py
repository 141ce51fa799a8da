"""``bench.ttft --nvme``: TTFT when the reused prefix lives only on NVMe (the store's DRAM is too small for it).

A second local stack (store, prefill and decode workers) whose store has a DRAM tier of ``DRAM`` (far less
than one prompt's KV) and an NVMe tier under ``--dir``, write-through and without promotion, so a Get of the
prefix reads every block from NVMe. Per chat prompt: ``disaggregated`` on that stack stores the prefix, a
filler Put of DRAM's size pushes whatever of it DRAM still held out, then ``store_nvme``: the decode worker
with the prefix only on NVMe. Just before it, one O_DIRECT read of a fresh extent of ``EXTENT_BYTES`` gives
the disk's read speed at that moment: ``floor_s`` of the ``store_nvme`` row is the compute of the uncached
tail plus the KV bytes at that speed (the DRAM modes' floor uses memcpy speed).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.nvme_raw import RawExtents
from kvstore.client import Client
from kvstore.router import Result, Router, local_stack

DRAM = 16 << 20
FILLER_BLOCK = 256 << 10
EXTENT_BLOCK = 2 << 20  # raw extents of 32 x (4 KiB + 2 MiB): about one prompt's KV


def run_nvme(
    model: str,
    prompts: list[list[int]],
    new_tokens: int,
    root: Path,
    share_nvme: bool = True,
    share_dram: str = "auto",
    worker_args: Sequence[str] = (),
) -> tuple[list[Result], list[float]]:
    """The ``store_nvme`` results (mode renamed) and the disk's read speed (bytes/s) measured before each.
    ``share_nvme``: the store runs with ``--share-nvme`` (the decode worker reads the NVMe blocks itself);
    ``share_dram``: the store's ``--share-dram`` (auto: its default, which shares the arena where the host allows;
    shared, the arena's index names those blocks beside its own, read without a request);
    ``worker_args``: flags for both workers."""
    results: list[Result] = []
    speeds: list[float] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-ttft-nvme-", dir=root))
    rng = np.random.default_rng(0)
    try:
        with ExitStack() as stack:
            store_args: tuple[str, ...] = ("--nvme-dir", str(tmp / "nvme"), "--write-policy", "write-through")
            store_args += ("--promote-on-hit", "false", "--share-nvme", "true" if share_nvme else "false")
            store_args += ("--share-dram", share_dram) if share_dram != "auto" else ()
            store, prefill, decode = stack.enter_context(
                local_stack(model, dram=f"{DRAM >> 20}MiB", store_args=store_args, worker_args=worker_args)
            )
            router = Router(prefill, decode)
            stack.callback(router.close)
            kv = stack.enter_context(Client(store))
            raw = RawExtents(tmp / "raw.bin", EXTENT_BLOCK, len(prompts), rng)
            stack.callback(raw.close)
            for j in range(len(prompts)):
                raw.write(j)  # before any prompt: each read below is of data written minutes earlier
            filler = rng.integers(0, 256, FILLER_BLOCK, dtype=np.uint8)
            for i, prompt in enumerate(tqdm(prompts, desc="prompts, prefix on NVMe", unit="prompt")):
                router.run("disaggregated", prompt, "chat", new_tokens)
                keys = [rng.bytes(16) for _ in range(DRAM // FILLER_BLOCK)]
                kv.put("filler", keys, [filler] * len(keys), chained=False)
                t0 = time.perf_counter()
                raw.read(i)
                speeds.append(raw.extent / (time.perf_counter() - t0))
                r = router.run("store", prompt, "chat", new_tokens)
                r.mode = "store_nvme"
                results.append(r)
            stats = kv.stats()
            nvme = {t["name"]: t["hits"] for t in stats["tiers"]}
            own = stats["counters"].get("lane_shm_disk_get_bytes", 0) / 2**20  # read by the workers themselves
            unasked = stats["counters"].get("lane_shm_index_hits", 0)  # of which found through the DRAM index
            print(
                f"prefix-on-NVMe store: hits per tier {nvme}; {own:.0f} MiB named to the clients in Get replies, "
                f"{unasked:.0f} blocks found by them in the DRAM index"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results, speeds


def nvme_row(rows: list[dict[str, Any]], results: list[Result], speeds: list[float]) -> None:
    """Set the ``store_nvme`` row's floor from the disk's measured speed (``rows`` from ``summarize``)."""
    for row in rows:
        if row["mode"] == "store_nvme":
            row["disk_read_gbps"] = round(statistics.median(speeds) / 1e9, 3)
            row["floor_s"] = round(
                statistics.mean(r.compute_s + r.transfer_bytes / s for r, s in zip(results, speeds)), 4
            )
            row["ttft_over_floor_p50"] = round(
                statistics.median(
                    r.ttft_s / max(r.compute_s + r.transfer_bytes / s, 1e-9) for r, s in zip(results, speeds)
                ),
                3,
            )
