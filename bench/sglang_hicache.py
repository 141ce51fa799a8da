"""SGLang's HiCache storage path through kvstore: ``KVStoreHiCacheStorage.batch_get_v1``/``batch_set_v1`` of
pages of an MHA host pool laid out as SGLang's ``page_first`` (``kv_buffer[2, tokens, layers, heads, dim]``,
SmolLM2-135M's geometry at 64 tokens a page, fp16: 1,474,560 bytes a page), against a ``kvstore serve``.

    python -m bench.sglang_hicache [--quick] [--out FILE.json] [--pages 64] [--stores copy,prefault,shared]

Stores: ``copy`` (the store copies each page in and out), ``prefault`` (the same with ``--dram-prefault true``,
measured once its DRAM pages are all made), ``shared`` (``--share-dram true``: Gets copied by the client).

Baseline in the same run: ``memcpy_s``, one torch copy of the same pages from one host pool into another (what
SGLang's own host tier costs for them). Rows: ``store``, ``verb``, ``pages``, ``mb``, ``seconds``, ``gbps``,
``memcpy_s``, ``vs_memcpy`` (memcpy / verb). Needs ``sglang`` importable (``make`` installs its package alone).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from bench.common import Row, parse_args, positive, report
from kvstore.server.process import store_process

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 64
PREFAULT_WAIT_S = 3.0
STORES = {
    "copy": ["--share-dram", "false"],
    "prefault": ["--share-dram", "false", "--dram-prefault", "true"],
    "shared": ["--share-dram", "true"],
}


class PageFirstPool:
    """The memory layout and ``get_page_buffer_meta`` of SGLang's MHA host pool, page_first:
    ``kv_buffer[2, tokens, layers, heads, dim]``, a page's K and V each one contiguous run (also the tests')."""

    layout, dtype = "page_first", torch.float16

    def __init__(self, pages: int, *, layers: int = LAYERS, heads: int = HEADS, dim: int = DIM, page: int = PAGE):
        self.page_size, self.layer_num, self.head_num, self.head_dim = page, layers, heads, dim
        self.kv_buffer = torch.randn((2, pages * page, layers, heads, dim)).to(self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        if len(indices) % self.page_size:
            raise ValueError(f"{len(indices)} indices are not whole pages of {self.page_size}")
        ptrs, sizes = [], []
        for first in indices.tolist()[:: self.page_size]:
            for kv in range(2):
                part = self.kv_buffer[kv, first : first + self.page_size]
                ptrs.append(part.data_ptr())
                sizes.append(part.nbytes)
        return ptrs, sizes

    def page(self, p: int) -> torch.Tensor:
        return self.kv_buffer[:, p * self.page_size : (p + 1) * self.page_size]


def backend_for(target: str, pool: PageFirstPool, **extra: Any) -> Any:
    """A ``KVStoreHiCacheStorage`` on ``target`` with ``pool`` registered, as SGLang's cache controller makes it;
    ``extra``: more of its ``extra_config``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvstore.integrations.sglang import KVStoreHiCacheStorage

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="smollm2",
        extra_config={"target": target, "interface_v1": 1, **extra},
    )  # fmt: skip
    backend = KVStoreHiCacheStorage(config, {})
    backend.register_mem_pool_host(pool)
    return backend


def _median(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rows(store: str, extra: list[str], pages: int, reps: int) -> list[Row]:
    src, dst = PageFirstPool(pages), PageFirstPool(pages)
    idx = torch.arange(pages * PAGE)
    nbytes = pages * 2 * PAGE * LAYERS * HEADS * DIM * 2
    memcpy_s = _median(lambda: dst.kv_buffer.copy_(src.kv_buffer), reps)
    rows: list[Row] = []
    with store_process("--dram", "2GiB", *extra) as (target, _):
        if "--dram-prefault" in extra:
            time.sleep(PREFAULT_WAIT_S)  # 2 GiB took 0.6-0.9 s here
        writer, reader = backend_for(target, src), backend_for(target, dst)
        keys = [[f"{r:04x}{i:060x}" for i in range(pages)] for r in range(reps + 1)]
        for verb in ("batch_set_v1", "batch_get_v1"):
            times = []
            for r in range(reps + 1):  # the first: lanes opened, pages touched
                fn = writer.batch_set_v1 if verb == "batch_set_v1" else reader.batch_get_v1
                t0 = time.perf_counter()
                ok = fn(keys[r], idx)
                if r:
                    times.append(time.perf_counter() - t0)
                assert all(ok), f"{verb}: {ok.count(False)} of {pages} pages failed"
            seconds = statistics.median(times)
            rows.append(
                {
                    "store": store,
                    "verb": verb,
                    "pages": pages,
                    "mb": round(nbytes / 1e6, 1),
                    "seconds": round(seconds, 4),
                    "gbps": round(nbytes / seconds / 1e9, 2),
                    "memcpy_s": round(memcpy_s, 4),
                    "vs_memcpy": round(memcpy_s / seconds, 2),
                }
            )
            print(f"[sglang_hicache] {rows[-1]}", file=sys.stderr, flush=True)
        assert torch.equal(dst.kv_buffer, src.kv_buffer)
        writer.clear()
        reader.clear()
    return rows


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument("--pages", type=positive(int), default=64, help="pages per call (default 64: 4,096 tokens)")
        p.add_argument("--reps", type=int, default=0, help="calls per case (default 9; quick 3)")
        p.add_argument("--stores", default="copy,prefault,shared", help="store modes: " + ", ".join(STORES))

    args = parse_args("SGLang HiCache pages through kvstore against memcpy", argv, configure)
    reps = args.reps or (3 if args.quick else 9)
    rows: list[Row] = []
    for store in args.stores.split(","):
        rows += _rows(store, STORES[store], args.pages, reps)
    report(rows, args, title="SGLang HiCache backend (page_first, 1,474,560-byte pages)", bench="sglang_hicache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
