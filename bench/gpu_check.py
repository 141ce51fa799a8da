"""The GPU check: one short script for a machine with a CUDA device (a few minutes).

    python -m bench.gpu_check [--dry-run] [--quick] [--out bench/results/gpu_check.json]

It runs, in order, and prints one table (every row also as JSON):
1. tests: the device-parametrized suites on `cuda` (tests/test_devices.py,
   tests/test_cuda_lane.py against a real `kvstore serve` process with an HBM
   tier, tests/test_nvme_kvikio.py), and the lane suites (cuda_ipc on its cpu
   stand-in there, as in CI);
2. HBM <-> DRAM: the HBM arena tier writing blocks from pinned host memory and
   reading them back (batched on a side stream, one synchronisation), and a
   store with HBM above DRAM demoting full HBM to DRAM, beside a bare
   `tensor.copy_` of the same bytes;
3. NVMe: the NVMe tier with the kvikio backend (GPUDirect Storage, or kvikio's
   compat mode, which the row names): reads land straight in HBM tensors
   (gds.py); writes of HBM tensors are staged through host memory (the segment
   writer combines records in host buffers); beside the plain path: device ->
   pinned host -> POSIX O_DIRECT pwrite, and back;
4. cuda_ipc lane: a `kvstore serve` process with an HBM tier; the client puts
   and gets 2 MiB bf16 blocks that live on the GPU (device to device through
   the lane's region), beside the same through the shm lane (pinned staging on
   the host) and a device-to-device copy in one process; p50/p99 of a single
   2 MiB Get;
5. the vLLM connector on a CUDA KV cache (`bench.vllm_load --device cuda`): loads of 62 SmolLM2-shaped blocks
   (91 MB) from a `kvstore serve` (the store copying, `--share-dram`, only on NVMe with `--share-nvme`) through
   pinned host staging and through device staging (the cuda_ipc lane, and the shm lane's own pinned buffers),
   every load checked bit-exact, beside one pinned host -> device `copy_` of the same bytes.
`--dry-run` prints this plan and what this machine has (torch, CUDA, kvikio)
without touching a device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.tiers.base import BlockMeta

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = [
    "tests/test_devices.py",
    "tests/test_cuda_lane.py",
    "tests/test_nvme_kvikio.py",
    "tests/test_gds.py",
    "tests/test_lanes_roundtrip.py",
    "tests/test_vllm_worker_staged.py",
]


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info.update(
            torch=torch.__version__,
            cuda=torch.cuda.is_available(),
            device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        )
    except ImportError:
        info.update(torch=None, cuda=False)
    try:
        import kvikio  # noqa: F401

        info["kvikio"] = getattr(kvikio, "__version__", "yes")
    except Exception as err:  # noqa: BLE001 - report why, whatever it is
        info["kvikio"] = f"unavailable ({type(err).__name__}: {err})"
    return info


def gbps(fn: Callable[[], Any], nbytes: int, reps: int) -> float:
    """Best of ``reps`` timed calls after one warm-up, synchronised, in GB/s."""
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return round(nbytes / best / 1e9, 2)


def run_tests(log: Path | None) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(tests.stdout + tests.stderr)
    lines = tests.stdout.strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return [
        {
            "check": "pytest " + " ".join(TEST_FILES),
            "passed": tests.returncode == 0,
            "summary": lines[-1] if lines else tests.stderr[-500:],
            "failures": failed[:10],
            "seconds": round(time.perf_counter() - t0, 1),
        }
    ]


def _metas(n: int, block: int, tag: str) -> list[BlockMeta]:
    from kvstore.tiers.base import BlockMeta

    return [BlockMeta(tag, i.to_bytes(16, "little"), b"", 0, "uint8", block, block, 0) for i in range(n)]


def hbm_dram(n: int, block: int, reps: int) -> list[dict[str, Any]]:
    import torch

    from kvstore.store import BlockStore
    from kvstore.tiers.arena import ArenaTier

    total = n * block
    tier = ArenaTier(total * 2, device="cuda", page_size=max(block, 8 << 20))
    host = [torch.randint(0, 255, (block,), dtype=torch.uint8).pin_memory() for _ in range(n)]
    metas = _metas(n, block, "hbm")
    locs: list[int] = []

    def write() -> None:
        if locs:
            tier.free(locs)
        locs[:] = tier.write(metas, host)

    w = gbps(write, total, reps)
    r = gbps(lambda: tier.read(locs, [block] * n, host), total, reps)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    h2d = gbps(lambda: dev.copy_(pinned, non_blocking=True), total, reps)
    d2h = gbps(lambda: pinned.copy_(dev, non_blocking=True), total, reps)

    # Demotion: a store whose HBM tier is full of blocks demotes them to DRAM in batches.
    hbm, dram = ArenaTier(total, device="cuda", page_size=max(block, 8 << 20)), ArenaTier(total * 2)
    store = BlockStore([hbm, dram], high_watermark=0.5, low_watermark=0.0)
    src = torch.randint(0, 255, (block,), dtype=torch.uint8, device="cuda")
    for m in _metas(n, block, "demote"):
        ticket = store.begin_put("demote", m)
        assert ticket is not None  # a fresh store and distinct hashes: every block is new
        ticket.buffer.copy_(src)
        store.commit_put(ticket)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    moved = store.demote_once()
    demote = round(moved / (time.perf_counter() - t0) / 1e9, 2)
    store.check_invariants()
    crc_rows = []
    from kvstore.crc_gpu import gpu_crc32c

    gpu, blocks = gpu_crc32c(), [dev[i * block : (i + 1) * block] for i in range(n)]
    if gpu is not None:
        from kvstore.checksum import crc32c

        def on_host() -> None:
            pinned.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            view = memoryview(pinned.numpy())
            for i in range(n):
                crc32c(view[i * block : (i + 1) * block])

        crc_rows.append(
            {
                "check": f"crc32c of {n} x {block >> 20} MiB on the GPU",
                "gbps": gbps(lambda: gpu.crcs(blocks), total, reps),
                "baseline": "d2h + CPU crc32c",
                "baseline_gbps": gbps(on_host, total, reps),
            }
        )
    return crc_rows + [
        {"check": "hbm tier write (from pinned host)", "gbps": w, "baseline": "h2d copy_", "baseline_gbps": h2d},
        {"check": "hbm tier read (to pinned host)", "gbps": r, "baseline": "d2h copy_", "baseline_gbps": d2h},
        {
            "check": f"store demotion hbm->dram ({moved >> 20} MiB)",
            "gbps": demote,
            "baseline": "d2h copy_",
            "baseline_gbps": d2h,
        },
    ]


def nvme(n: int, block: int, reps: int) -> list[dict[str, Any]]:
    import torch

    from kvstore.tiers.nvme import NvmeTier
    from kvstore.tiers.nvme.io import KvikioBackend, PosixBackend

    total = n * block
    dev = [torch.randint(0, 255, (block,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    rows: list[dict[str, Any]] = []
    for name, make in (("kvikio", KvikioBackend), ("posix via pinned host", PosixBackend)):
        try:
            backend = make()
        except Exception as err:  # noqa: BLE001 - kvikio may not load: say why
            rows.append({"check": f"nvme {name}", "error": f"{type(err).__name__}: {err}"})
            continue
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_GPU_CHECK_DIR", "/var/tmp")) as d:
            tier = NvmeTier(d, total * (reps + 3) * 2, segment_bytes=256 << 20, backend=backend)
            staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            host = [staging[i * block : (i + 1) * block] for i in range(n)]
            metas = _metas(n, block, "gds")
            locs: list[int] = []

            def write() -> None:
                if name == "kvikio":
                    locs[:] = tier.write(metas, dev)
                else:  # device -> pinned host -> file
                    for h, t in zip(host, dev):
                        h.copy_(t, non_blocking=True)
                    torch.cuda.synchronize()
                    locs[:] = tier.write(metas, [h.numpy() for h in host])

            outs = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(n)]

            def read() -> None:
                _drop_page_cache(d)  # kvikio's compatibility path reads through it: a read must reach the disk
                if name == "kvikio":
                    tier.read(locs, [block] * n, outs)
                else:  # file -> pinned host -> device
                    tier.read(locs, [block] * n, [h.numpy() for h in host])
                    for o, h in zip(outs, host):
                        o.copy_(h, non_blocking=True)

            w, r = gbps(write, total, reps), gbps(read, total, reps)
            exact = all(torch.equal(a, b) for a, b in zip(outs, dev))
            rows += [
                {"check": f"nvme write {name}", "gbps": w, "backend": tier.stats().backend, "exact": exact},
                {"check": f"nvme read {name}", "gbps": r, "backend": tier.stats().backend, "exact": exact},
            ]
            tier.close()
    return rows


def _drop_page_cache(directory: str) -> None:
    """Ask the kernel to drop the cached pages of every file here: on a VM without real GPUDirect Storage kvikio
    read a file just written at 36 GB/s (16 threads) where O_DIRECT read it at 1.4-1.9."""
    for entry in os.scandir(directory):
        if entry.is_file():
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _latency(fn: Callable[[], Any], n: int = 50) -> dict[str, float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "p50_ms": round(statistics.median(times) * 1e3, 3),
        "p99_ms": round(times[int(len(times) * 0.99) - 1] * 1e3, 3),
    }


def cuda_ipc_lane(n: int, block: int, reps: int) -> list[dict[str, Any]]:
    import torch

    from kvstore.client import Client
    from kvstore.server.process import store_process

    total = n * block
    rows = []
    args = (
        "--hbm",
        "8GiB",
        "--dram",
        "2GiB",
        "--max-block",
        "32MiB",  # room for every round: no eviction
        "--cuda-lane-bytes",
        f"{max(total, 64 << 20)}",
        "--shm-lane-bytes",
        f"{max(total, 64 << 20)}",
    )
    with store_process(*args, timeout=90) as (target, _):
        for size, count in ((block, n), (16 << 20, max(1, total // (16 << 20)))):
            blocks = [torch.randn(size // 2, device="cuda").to(torch.bfloat16) for _ in range(count)]
            outs = [torch.empty_like(b) for b in blocks]
            src = torch.cat([b.view(torch.uint8) for b in blocks])
            dst = torch.empty_like(src)
            d2d = gbps(lambda: dst.copy_(src), size * count, reps)
            for lane in ("auto", "shm"):  # auto: cuda_ipc for CUDA tensors; shm: pinned host staging per call
                with Client(target, lane=lane) as kv:
                    keys = [f"{lane}-{size}-{i}".encode()[:16].ljust(16, b"\0") for i in range(count)]
                    rounds = iter(range(1 << 30))

                    def put_fresh() -> None:  # new hashes each time: a repeated Put would only dedup
                        r = next(rounds).to_bytes(4, "little")
                        results = kv.put("gpu", [r + k[4:] for k in keys], blocks, chained=False)
                        assert all(x.status == "stored" for x in results), results[0]

                    put = gbps(put_fresh, size * count, reps)
                    kv.put("gpu", keys, blocks, chained=False)
                    get = gbps(lambda: kv.get("gpu", keys, out=outs), size * count, reps)
                    exact = all(torch.equal(a, b) for a, b in zip(outs, blocks))
                    used = kv._device_lanes.kind if lane == "auto" else f"{kv.lane_kind}+staging"
                    what = f"{size >> 20} MiB x{count}"
                    rows += [
                        {
                            "check": f"lane {used} put {what}",
                            "gbps": put,
                            "exact": exact,
                            "baseline": "d2d copy_",
                            "baseline_gbps": d2d,
                        },
                        {
                            "check": f"lane {used} get {what}",
                            "gbps": get,
                            "exact": exact,
                            "baseline": "d2d copy_",
                            "baseline_gbps": d2d,
                        },
                    ]
                    if size == block:
                        rows.append(
                            {
                                "check": f"lane {used} single {size >> 20} MiB get latency",
                                **_latency(lambda: kv.get("gpu", keys[:1], out=outs[:1])),
                            }
                        )
                        rows.append(
                            {
                                "check": "grpc Lookup of one hash (the RPC floor)",
                                **_latency(lambda: kv.lookup("gpu", keys[:1])),
                            }
                        )
    return rows


def vllm_connector(quick: bool) -> list[dict[str, Any]]:
    from bench import vllm_load

    rows = vllm_load.measure(
        ["copy", "shared", "nvme"], [62], reps=3 if quick else 5, streams=[1, 2], verifies=[True], device="cuda"
    )
    return [
        {"check": f"vllm connector load {r['store']} {r['staging']} staging lane {r['lane_used']}", **r} for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and this machine's GPU stack; run nothing")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    p.add_argument("--skip-tests", action="store_true", help="only the measurements")
    p.add_argument(
        "--out", type=Path, default=None, metavar="FILE.json", help="write the rows here (the pytest log beside it)"
    )
    args = p.parse_args(argv)
    env = environment()
    if args.dry_run:
        print(__doc__)
        print("this machine:", json.dumps(env))
        if not env.get("cuda"):
            print("no CUDA device here: every step above would be skipped; run it where `nvidia-smi` works")
        return 0
    if not env.get("cuda"):
        print("no CUDA device: nothing to check (see --dry-run)", file=sys.stderr)
        return 2
    n, block, reps = (16, 2 << 20, 3) if args.quick else (64, 2 << 20, 5)
    rows: list[dict[str, Any]] = [{"check": "environment", **env}]
    steps: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = (
        []
        if args.skip_tests
        else [("tests", lambda: run_tests(args.out.with_suffix(".pytest.txt") if args.out else None))]
    )
    steps += [
        ("hbm_dram", lambda: hbm_dram(n, block, reps)),
        ("nvme", lambda: nvme(n, block, reps)),
        ("cuda_ipc", lambda: cuda_ipc_lane(n, block, reps)),
        ("vllm_connector", lambda: vllm_connector(args.quick)),
    ]
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            got = fn()
        except Exception as err:  # noqa: BLE001 - one failing check must not hide the others
            import traceback

            got = [{"check": name, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}]
        for r in got:
            print(json.dumps(r), flush=True)
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows += got
    print()
    for r in rows[1:]:
        cells = [f"{k}={v}" for k, v in r.items() if k not in ("check", "trace", "failures")]
        print(f"{r['check']:<48} " + "  ".join(cells))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
