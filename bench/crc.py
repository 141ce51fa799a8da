"""What a block's CRC32C costs: the compiled folding loops against the `crc32c` package and a plain copy.

    python -m bench.crc [--quick] [--out bench/results/crc.json]

Every check a Get makes (a record read from NVMe, a block copied out of shared DRAM) is a CRC32C over bytes
that are, as a rule, not in the CPU's caches: a disk's DMA or another process wrote them last. So each size is
measured twice: ``cache`` (the same buffer again and again) and ``memory`` (each call at a fresh place of a pool
16x the last-level cache, in turn). Rows, GB/s (median of the calls):

- ``wide``: ``memops_kernels.copy_crc``, which folds 128 bytes a step in 256-bit registers where the CPU has
  AVX2 and VPCLMULQDQ (``memops_kernels.WIDE``), else the same as ``narrow``;
- ``narrow``: ``memops_kernels.copy_crc_narrow``, the 64-byte loop in 128-bit registers (every CPU the kernels
  run on; the loop before the wide one existed);
- ``package``: the `crc32c` package (CRC32 instructions), the baseline;
- ``copy_wide`` / ``copy_narrow``: a copy with its CRC32C in one pass (as a DRAM hit is served), and ``memcpy``
  (``np.copyto`` of the same bytes, no CRC32C), the copy's baseline.

``wide_vs_package`` and ``wide_vs_narrow``, ``copy_wide_vs_memcpy``: ratios within the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import cast

import numpy as np
from crc32c import crc32c

from bench.common import parse_args, report
from kvstore import memops_jit

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 2 * MiB, 64 * MiB)


def _median_gbps(n: int, calls: list[Callable[[], object]]) -> float:
    times = []
    for call in calls:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times) / 1e9


def measure(n: int, place: str, pool: np.ndarray, dst: np.ndarray, calls: int) -> dict[str, object]:
    from kvstore import memops_kernels as k  # numba: imported once the kernels are wanted, as memops_jit does

    if place == "cache":
        starts = [0] * calls
    else:  # each call at the next place of the pool, which the last calls' bytes have long left
        slots = pool.nbytes // n
        starts = [(i % slots) * n for i in range(calls)]
    base, out = int(pool.ctypes.data), int(dst.ctypes.data)

    def run(fn: Callable[[int], object]) -> float:
        fn(starts[0])  # compiled, faulted in
        return _median_gbps(n, [cast("Callable[[], object]", lambda s=s: fn(s)) for s in starts])

    wide = run(lambda s: k.copy_crc(base + s, 0, n, 0, k.READ))
    narrow = run(lambda s: k.copy_crc_narrow(base + s, 0, n, 0, k.READ))
    package = run(lambda s: crc32c(pool.data[s : s + n]))
    copy_wide = run(lambda s: k.copy_crc(base + s, out, n, 0, k.STORE))
    copy_narrow = run(lambda s: k.copy_crc_narrow(base + s, out, n, 0, k.STORE))
    memcpy = run(lambda s: np.copyto(dst[:n], pool[s : s + n]))
    return {
        "bytes": n, "place": place, "wide_loop": bool(k.WIDE), "wide": wide, "narrow": narrow, "package": package,
        "copy_wide": copy_wide, "copy_narrow": copy_narrow, "memcpy": memcpy, "wide_vs_package": wide / package,
        "wide_vs_narrow": wide / narrow, "copy_wide_vs_memcpy": copy_wide / memcpy,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args("CRC32C GB/s: the compiled loops against the crc32c package and memcpy", argv)
    memops_jit.warm_up()
    pool = np.random.default_rng(0).integers(0, 256, (128 if args.quick else 512) * MiB, dtype=np.uint8)
    dst = np.zeros(max(SIZES), dtype=np.uint8)
    rows = []
    for n in SIZES:
        calls = max(8, min(400, (2 if args.quick else 8) * (256 * MiB) // n))
        for place in ("cache", "memory"):
            rows.append(measure(n, place, pool, dst, calls))
    report(
        rows,
        args,
        title="CRC32C and copy+CRC32C, GB/s (median of calls); memory: each call at a fresh place of a pool",
        bench="crc",
    )


if __name__ == "__main__":
    main()
