"""The GPU check: one short script for a machine with a CUDA device (under 5 minutes).

    python -m bench.gpu_check [--dry-run] [--quick] [--out bench/results/gpu_check.json]

It runs, in order:
1. the device-parametrized tests on `cuda` (`pytest -m cuda tests/test_devices.py`);
2. HBM <-> DRAM copy GB/s: the HBM arena tier (torch tensor on cuda) writing
   and reading pinned host blocks, beside a bare `tensor.copy_` of the same bytes;
3. GPUDirect Storage: kvikio CuFile write/read GB/s of 2 MiB blocks straight
   between HBM and a segment file, beside the plain path (device -> pinned host
   -> O_DIRECT pwrite, and back);
4. CUDA IPC: a second process maps an exported HBM region (torch's CUDA IPC
   handles) and copies blocks out of it device to device, beside a
   device-to-device copy in one process.
It prints a table and writes JSON rows. `--dry-run` prints this plan and what
this machine has (torch, CUDA, kvikio) without touching a device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        info.update(torch=None, cuda=False)
    try:
        import kvikio  # noqa: F401

        info["kvikio"] = getattr(kvikio, "__version__", "yes")
    except Exception as err:  # noqa: BLE001 - report why, whatever it is
        info["kvikio"] = f"unavailable ({type(err).__name__}: {err})"
    return info


def timed(fn: Callable[[], None], nbytes: int, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def hbm_dram(n_blocks: int, block: int, reps: int) -> list[dict]:
    import torch

    from kvstore.tiers.arena import ArenaTier
    from kvstore.tiers.base import BlockMeta

    tier = ArenaTier(n_blocks * block * 2, device="cuda", page_size=max(block, 8 << 20))
    host = [torch.empty(block, dtype=torch.uint8, pin_memory=True).random_(0, 255) for _ in range(n_blocks)]
    metas = [BlockMeta("gpu", i.to_bytes(16, "little"), b"", 0, "uint8", block, block, 0) for i in range(n_blocks)]
    locs: list[int] = []

    def write() -> None:
        if locs:
            tier.free(locs)
        locs[:] = tier.write(metas, host)

    total = n_blocks * block
    w = timed(write, total, reps)
    r = timed(lambda: tier.read(locs, [block] * n_blocks, host), total, reps)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    h2d = timed(lambda: dev.copy_(pinned, non_blocking=True), total, reps)
    d2h = timed(lambda: pinned.copy_(dev, non_blocking=True), total, reps)
    return [{"check": "hbm_tier_write_from_pinned", "gbps": round(w, 2), "baseline": "h2d copy_", "baseline_gbps": round(h2d, 2)},
            {"check": "hbm_tier_read_to_pinned", "gbps": round(r, 2), "baseline": "d2h copy_", "baseline_gbps": round(d2h, 2)}]


def gds(n_blocks: int, block: int, reps: int) -> list[dict]:
    import torch

    from kvstore.tiers.base import BlockMeta
    from kvstore.tiers.nvme import NvmeTier
    from kvstore.tiers.nvme.io import KvikioBackend, PosixBackend

    total = n_blocks * block
    dev = [torch.randint(0, 255, (block,), dtype=torch.uint8, device="cuda") for _ in range(n_blocks)]
    metas = [BlockMeta("gpu", i.to_bytes(16, "little"), b"", 0, "uint8", block, block, 0) for i in range(n_blocks)]
    rows = []
    for name, backend in (("kvikio", KvikioBackend()), ("posix_via_host", PosixBackend())):
        with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_GPU_CHECK_DIR", "/var/tmp")) as d:
            tier = NvmeTier(d, total * (reps + 3) * 2, segment_bytes=256 << 20, backend=backend)
            staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            if name == "kvikio":
                sources: Any = dev
                write = lambda: tier.write(metas, sources)  # noqa: E731
            else:  # the plain path: device -> pinned host -> file
                def write() -> list[int]:
                    for i, t in enumerate(dev):
                        staging[i * block:(i + 1) * block].copy_(t)
                    torch.cuda.synchronize()
                    return tier.write(metas, [staging[i * block:(i + 1) * block].numpy() for i in range(n_blocks)])
            t0 = time.perf_counter()
            locs = None
            for _ in range(reps):
                locs = write()
            w = total * reps / (time.perf_counter() - t0) / 1e9
            outs = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(n_blocks)]
            t0 = time.perf_counter()
            for _ in range(reps):
                if name == "kvikio":
                    tier.read(locs, [block] * n_blocks, outs)
                else:
                    tier.read(locs, [block] * n_blocks, [staging[i * block:(i + 1) * block].numpy() for i in range(n_blocks)])
                    for i, o in enumerate(outs):
                        o.copy_(staging[i * block:(i + 1) * block], non_blocking=True)
                torch.cuda.synchronize()
            r = total * reps / (time.perf_counter() - t0) / 1e9
            assert all(torch.equal(a, b) for a, b in zip(outs, dev)), f"{name}: read back other bytes"
            rows += [{"check": f"nvme_write_{name}", "gbps": round(w, 2), "backend": tier.stats().backend},
                     {"check": f"nvme_read_{name}", "gbps": round(r, 2), "backend": tier.stats().backend}]
            tier.close()
    return rows


def _ipc_child(q: Any, n: int, reps: int) -> None:
    """Runs in a second process: maps the parent's HBM tensor by its CUDA IPC handle and copies out of it."""
    import torch

    src = q.get()  # torch.multiprocessing passes CUDA tensors as IPC handles
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    q.put((n * reps / (time.perf_counter() - t0) / 1e9, bool(torch.equal(dst, src))))


def cuda_ipc(total: int, reps: int) -> list[dict]:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    d2d = timed(lambda: dst.copy_(src), total, reps)
    q = ctx.SimpleQueue()
    proc = ctx.Process(target=_ipc_child, args=(q, total, reps))
    proc.start()
    q.put(src)
    gbps, exact = q.get()
    proc.join(60)
    return [{"check": "cuda_ipc_copy_from_peer_process", "gbps": round(gbps, 2), "exact": exact,
             "baseline": "d2d copy_ in one process", "baseline_gbps": round(d2d, 2)}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and this machine's GPU stack; run nothing")
    p.add_argument("--quick", action="store_true", help="smaller sizes")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
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
    n_blocks, block, reps = (16, 2 << 20, 3) if args.quick else (64, 2 << 20, 5)
    rows: list[dict] = [{"check": "environment", **env}]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_devices.py"],
                           cwd=ROOT, capture_output=True, text=True, timeout=240)
    rows.append({"check": "pytest -m cuda tests/test_devices.py", "passed": tests.returncode == 0,
                 "summary": tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-500:]})
    for name, fn in (("hbm_dram", lambda: hbm_dram(n_blocks, block, reps)),
                     ("gds", lambda: gds(n_blocks, block, reps)),
                     ("cuda_ipc", lambda: cuda_ipc(n_blocks * block, reps))):
        try:
            rows += fn()
        except Exception as err:  # noqa: BLE001 - one failing check must not hide the others
            rows.append({"check": name, "error": f"{type(err).__name__}: {err}"})
    for r in rows:
        print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
