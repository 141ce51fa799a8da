"""The vLLM connector's load path alone: ``WorkerSide.load`` of a prompt's blocks into a KV cache laid out as
vLLM's CPU backend lays it out (30 layers, LBHNC, SmolLM2's 1,474,560-byte blocks), from a ``kvstore serve``.

    python -m bench.vllm_load [--quick] [--out FILE.json] [--blocks 62,109] [--streams 1,2] [--verify 1,0] [--tokens 32]
                              [--device cuda --staging host,device]

Per store (``copy``: the store copies each block into the cache itself, ``process_vm_writev`` on shm;
``shared``: ``serve --share-dram``, the client copies DRAM hits from the mapped arena; ``nvme``: every block
only on the store's NVMe tier (written by a graceful stop, read back by a restarted store with
``--promote-on-hit false`` and ``--share-nvme true``: the client reads the files into the pages itself)),
lane (shm, tcp; tcp only against ``copy``), ``load_streams`` and ``verify_loads``: the median seconds of a load (every block
lands in place in the cache's 30 per-layer pages), and in the same run the baseline: one ``torch`` copy of
the same bytes from one contiguous buffer into the cache's pages (what an in-process cache hit would cost).
Rows: ``store``, ``lane``, ``streams``, ``verify``, ``blocks``, ``page_bytes``, ``load_s``, ``gbps``, ``memcpy_s``,
``vs_memcpy`` (memcpy / load).

``--device cuda`` (a GPU host: ``bench.gpu_check`` runs it) puts the cache on the GPU, as vLLM's CUDA backend
does, and loads it through the connector's staging buffers (``--staging``: pinned host buffers over the host
lanes, or device buffers over the cuda_ipc lane (``auto``) or the shm lane's pinned staging); the baseline is one
``copy_`` of the same bytes from one pinned host buffer into the pages, and a load is timed until its copies
have landed (``torch.cuda.synchronize``). Rows then add ``device``, ``staging`` and ``lane_used``.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from bench.common import Row, parse_args, positive, report
from kvstore import memops_jit
from kvstore.client import Client
from kvstore.integrations.vllm.plan import BlockRun, StepPlan
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.server.process import store_process

LAYERS, HEADS, TOKENS, WIDTH = 30, 3, 32, 128  # SmolLM2-135M at block 32, fp32: 49,152 bytes a layer page


def _page_bytes(tokens: int) -> int:
    """One layer's page of a block of ``tokens`` tokens (fp32)."""
    return HEADS * tokens * WIDTH * 4


def _cache(blocks: int, device: str = "cpu", tokens: int = TOKENS) -> dict[str, torch.Tensor]:
    per = blocks * HEADS * tokens * WIDTH
    buf = torch.zeros(LAYERS * per, device=device)
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per : (i + 1) * per].view(blocks, HEADS, tokens, WIDTH)
        for i in range(LAYERS)
    }


def _keys(n: int) -> tuple[bytes, ...]:
    return tuple(i.to_bytes(16, "little") for i in range(n))


def _memcpy_s(cache: dict[str, torch.Tensor], blocks: int, reps: int) -> float:
    """One copy of the same bytes from one contiguous host buffer (pinned for a device cache) into each layer's
    pages."""
    layers = [t[:blocks].reshape(-1) for t in cache.values()]
    on_device = layers[0].is_cuda
    src = torch.randn(len(layers), layers[0].numel())
    if on_device:
        src = src.pin_memory()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer, row in zip(layers, src):
            layer.copy_(row, non_blocking=on_device)
        _settle(on_device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _settle(on_device: bool) -> None:
    if on_device:
        torch.cuda.synchronize()


def _kernels_ready(timeout: float = 60.0) -> None:
    """Wait for the copy and CRC32C kernels that ``register`` starts compiling (or loading from numba's cache) in
    the background: loads before they are ready take the slow fallbacks, and measured that way the first case of a
    run was the slowest whatever it was (unverified 72.8 ms, then verified 51.4, for 62 blocks from NVMe)."""
    deadline = time.monotonic() + timeout
    while not memops_jit.ready() and time.monotonic() < deadline:
        time.sleep(0.05)


def _fill(target: str, src: dict[str, torch.Tensor], top: int) -> None:
    producer = WorkerSide(lambda: Client(target, lane="shm"), dtype="float32", saves=True)
    producer.register(src)
    producer.save(StepPlan(saves=[BlockRun("fill", "bench", _keys(top), tuple(range(top)))]))
    deadline = time.monotonic() + 120
    while not producer.finished_sending({"fill"}):
        if time.monotonic() > deadline:
            raise RuntimeError("the blocks were not stored in 120 s")
        time.sleep(0.05)
    producer.close()


@contextmanager
def _filled_store(store: str, extra: list[str], src: dict[str, torch.Tensor], top: int) -> Iterator[str]:
    """A store process holding the first ``top`` blocks of ``src``; for ``nvme``, only on its NVMe tier."""
    if store != "nvme":
        with store_process("--dram", "2GiB", *extra) as (target, _):
            _fill(target, src, top)
            yield target
        return
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-load-") as tmp:
        tier = ["--nvme-dir", tmp, "--nvme", "4GiB"]
        with store_process("--dram", "2GiB", *tier) as (target, _):
            _fill(target, src, top)  # a graceful stop writes them to NVMe
        with store_process("--dram", "2GiB", *tier, "--promote-on-hit", "false", *extra) as (target, _):
            yield target


def _store_rows(
    store: str,
    extra: list[str],
    lanes: tuple[str, ...],
    streams: list[int],
    verifies: list[bool],
    sizes: list[int],
    top: int,
    reps: int,
    device: str = "cpu",
    staging: str = "auto",
    tokens: int = TOKENS,
    huge: tuple[bool, ...] = (True,),
) -> list[Row]:
    rows: list[Row] = []
    src = _cache(top + 1, tokens=tokens)
    for t in src.values():
        t.normal_()
    on_device = device != "cpu"
    with _filled_store(store, extra, src, top) as target:
        for lane in lanes:
            for n, verify, huge_pages in itertools.product(streams, verifies, huge):
                side = WorkerSide(
                    cast("Callable[[], Client]", lambda lane=lane: Client(target, lane=lane)),
                    dtype="float32",
                    load_streams=n,
                    verify_loads=verify,
                    staging=staging,
                    huge_pages=huge_pages,
                )
                cache = _cache(top + 1, device, tokens)
                side.register(cache)
                _kernels_ready()
                side.huge_pages_settled(120)  # the collapse under the cache runs in the background
                for blocks in sizes:
                    run = BlockRun("q", "bench", _keys(blocks), tuple(range(1, blocks + 1)))
                    side.load(StepPlan(loads=[run]))  # lanes opened, pages touched
                    _settle(on_device)
                    times = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        side.load(StepPlan(loads=[run]))
                        _settle(on_device)
                        times.append(time.perf_counter() - t0)
                    assert side.take_load_errors() == set()
                    for name in cache:
                        assert torch.equal(cache[name][1 : blocks + 1].cpu(), src[name][:blocks])
                    load_s = statistics.median(times)
                    memcpy_s = _memcpy_s(cache, blocks, reps)
                    nbytes = blocks * side.counters.block_bytes
                    device_cells = (
                        {"device": device, "staging": side.staging_place, "lane_used": side.counters.lane}
                        if on_device
                        else {}
                    )
                    rows.append(
                        {
                            "store": store,
                            **device_cells,
                            "lane": lane,
                            "streams": n,
                            "verify": verify,
                            "huge_pages": huge_pages,
                            "blocks": blocks,
                            "page_bytes": _page_bytes(tokens),
                            "mb": round(nbytes / 1e6, 1),
                            "load_s": round(load_s, 4),
                            "gbps": round(nbytes / load_s / 1e9, 2),
                            "memcpy_s": round(memcpy_s, 4),
                            "vs_memcpy": round(memcpy_s / load_s, 2),
                        }
                    )
                    print(f"[vllm_load] {rows[-1]}", file=sys.stderr, flush=True)
                side.close()
    return rows


def measure(
    stores: list[str],
    sizes: list[int],
    *,
    reps: int,
    streams: list[int],
    verifies: list[bool],
    device: str = "cpu",
    stagings: list[str] | None = None,
    tokens: int = TOKENS,
    huge: tuple[bool, ...] = (True,),
) -> list[Row]:
    """Every case's rows (``bench.gpu_check`` calls this with ``device="cuda"``)."""
    rows: list[Row] = []
    top = max(sizes)
    for store in stores:
        extra = {"shared": ["--share-dram", "true"], "nvme": ["--share-nvme", "true"]}.get(
            store, ["--share-dram", "false"]
        )
        if device == "cpu":
            lanes = ("shm", "tcp") if store == "copy" else ("shm",)
            rows += _store_rows(store, extra, lanes, streams, verifies, sizes, top, reps, tokens=tokens, huge=huge)
            continue
        for staging in stagings or ["host", "device"]:
            # auto: device staging takes the cuda_ipc lane where the store offers it; shm: its pinned staging
            lanes = ("auto", "shm") if staging == "device" and store == "copy" else ("auto",)
            rows += _store_rows(store, extra, lanes, streams, verifies, sizes, top, reps, device, staging, tokens)
    return rows


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument("--blocks", default="", help="blocks per load (default 62,109: 2k and 3.5k tokens)")
        p.add_argument("--streams", default="1,2", help="load_streams values")
        p.add_argument("--reps", type=int, default=0, help="loads per case (default 9; quick 3)")
        p.add_argument("--verify", default="1,0", help="verify_loads values (1: CRC32C every block on load)")
        p.add_argument(
            "--stores",
            default="copy,shared",
            help="store modes: copy, shared (serve --share-dram), nvme (on NVMe only)",
        )
        p.add_argument(
            "--tokens",
            type=positive(int),
            default=TOKENS,
            help="tokens a block (default 32: SmolLM2's 49,152-byte pages; 2: 3,072-byte pages, where the cost "
            "per page shows)",
        )
        p.add_argument(
            "--huge-pages",
            default="1",
            help="the connector's huge_pages values for a CPU cache (1: huge pages asked for under it; 1,0: both, "
            "each case in turn)",
        )
        p.add_argument("--device", default="cpu", help="the KV cache's device: cpu (vLLM's CPU backend) or cuda")
        p.add_argument(
            "--staging",
            default="host,device",
            help="with --device cuda: the connector's staging buffers, host (pinned) and/or device",
        )

    args = parse_args("The vLLM connector's load path: WorkerSide.load against memcpy", argv, configure)
    sizes = [int(x) for x in args.blocks.split(",")] if args.blocks else ([62] if args.quick else [62, 109])
    rows = measure(
        args.stores.split(","),
        sizes,
        reps=args.reps or (3 if args.quick else 9),
        streams=[int(x) for x in args.streams.split(",")],
        verifies=[bool(int(x)) for x in args.verify.split(",")],
        device=args.device,
        stagings=args.staging.split(","),
        tokens=args.tokens,
        huge=tuple(bool(int(x)) for x in args.huge_pages.split(",")),
    )
    title = f"vLLM connector load path ({LAYERS} x {_page_bytes(args.tokens):,}-byte pages a block)"
    report(rows, args, title=title, bench="vllm_load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
