"""Scatter-gather blocks through the client: a vLLM-shaped block as 30 per-layer buffers (``Segments``).

Run by ``python -m bench.transfer`` (``--cases segments``). vLLM's CPU KV cache holds each layer in its own
tensor, so one block (SmolLM2-135M, block_size 32: 3 kv heads x 32 tokens x 2x64 fp32 = 49,152 bytes per layer)
is 30 slices of 48 KiB, 1.47 MB in all. For 64 blocks per call, put and get, on each lane, in one run and
interleaved repetition by repetition, the same bytes moved three ways:

- ``segments``: ``SegmentRows(layers).block(b)`` per block (the rows object made once, as a connector makes it
  when the KV cache is registered; the blocks' Segments are built inside the timing), put from / got into
  the layers' tensors;
- ``slices``: the same through the generic constructor, ``Segments([layer[b] for layer in layers])``, which
  slices 30 tensors per block and asks each for its address (the per-part cost ``SegmentRows`` avoids);
- ``contiguous``: each block as one contiguous 1.47 MB slice of a pool (the lane at its best, no layers);
- ``gather``: what a connector without Segments does: gather each block's layer slices into a staging buffer
  (one copy per layer across the 64 blocks) and put the staging blocks; get into the staging buffer and
  scatter it back into the layers.

Each row is one (op, lane) with the GB/s of each (block bytes / median seconds) and the ratios
``segments_vs_contiguous``, ``segments_vs_gather`` and ``slices_vs_gather``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from kvstore.client import Client, Segments
from kvstore.payload import SegmentRows

if TYPE_CHECKING:  # numpy's stubs give ndarray __buffer__ only from Python 3.12 (collections.abc.Buffer's too)
    from typing_extensions import Buffer

LAYERS = 30
LAYER_SHAPE = (3, 32, 128)  # kv heads, block size, 2 x head size (K and V), fp32: 49,152 bytes
BATCH = 64
VARIANTS = ("segments", "slices", "contiguous", "gather")


class Layout:
    """The source KV cache (one tensor per layer), a destination cache of the same shape, a contiguous pool
    of the same bytes, and the staging buffer of the gather path."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.src = [torch.rand((BATCH, *LAYER_SHAPE), generator=gen) for _ in range(LAYERS)]
        self.dst = [torch.zeros((BATCH, *LAYER_SHAPE)) for _ in range(LAYERS)]
        self.layer_bytes = self.src[0][0].nbytes
        self.block_bytes = self.layer_bytes * LAYERS
        self.pool = np.frombuffer(os.urandom(self.block_bytes * BATCH), dtype=np.uint8).copy()
        self.pool_out = np.zeros_like(self.pool)
        self.staging = torch.empty((BATCH, LAYERS, self.layer_bytes), dtype=torch.uint8)
        self.src_rows, self.dst_rows = SegmentRows(self.src), SegmentRows(self.dst)

    def blocks(self, pool: np.ndarray) -> list[memoryview]:
        n = self.block_bytes
        return [memoryview(cast("Buffer", pool[i * n : (i + 1) * n])) for i in range(BATCH)]

    @staticmethod
    def slices(layers: list[torch.Tensor]) -> list[Segments]:
        return [Segments([layer[b] for layer in layers]) for b in range(BATCH)]

    @staticmethod
    def rows(rows: SegmentRows) -> list[Segments]:
        return [rows.block(b) for b in range(BATCH)]

    def gather(self) -> list[memoryview]:
        for i, layer in enumerate(self.src):
            self.staging[:, i].copy_(layer.reshape(BATCH, -1).view(torch.uint8))
        return self.blocks(self.staging.reshape(-1).numpy())

    def scatter(self) -> None:
        for i, layer in enumerate(self.dst):
            layer.reshape(BATCH, -1).view(torch.uint8).copy_(self.staging[:, i])

    def clear(self) -> None:
        for layer in self.dst:
            layer.zero_()
        self.pool_out[:] = 0

    def check(self, variant: str) -> None:
        if variant == "contiguous":
            assert np.array_equal(self.pool, self.pool_out)
        else:
            assert all(torch.equal(a, b) for a, b in zip(self.src, self.dst)), variant


def _put(kv: Client, layout: Layout, variant: str, keys: list[bytes]) -> None:
    if variant == "segments":
        payloads: list[Any] = layout.rows(layout.src_rows)
    elif variant == "slices":
        payloads = layout.slices(layout.src)
    elif variant == "contiguous":
        payloads = layout.blocks(layout.pool)
    else:
        payloads = layout.gather()
    assert all(r.status == "stored" for r in kv.put("bench", keys, payloads))


def _get(kv: Client, layout: Layout, variant: str, keys: list[bytes]) -> None:
    if variant == "segments":
        kv.get("bench", keys, out=layout.rows(layout.dst_rows))
    elif variant == "slices":
        kv.get("bench", keys, out=layout.slices(layout.dst))
    elif variant == "contiguous":
        kv.get("bench", keys, out=layout.blocks(layout.pool_out))
    else:
        kv.get("bench", keys, out=layout.blocks(layout.staging.reshape(-1).numpy()))
        layout.scatter()


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(target: str, lanes: list[str], reps: int) -> list[dict[str, Any]]:
    """One row per (op, lane): GB/s of each variant and the ratios of segments to the other two."""
    layout = Layout()
    rows = []
    for lane in lanes:
        seconds: dict[tuple[str, str], list[float]] = {(op, v): [] for op in ("put", "get") for v in VARIANTS}
        with Client(target, timeout=120, lane=lane) as kv:
            for rep in range(reps + 1):  # the first repetition warms up the lane and the pages
                for variant in VARIANTS:
                    keys = [os.urandom(16) for _ in range(BATCH)]
                    put_s = _timed(lambda: _put(kv, layout, variant, keys))
                    layout.clear()
                    get_s = _timed(lambda: _get(kv, layout, variant, keys))
                    layout.check(variant)
                    kv.delete("bench", keys)
                    if rep:
                        seconds[("put", variant)].append(put_s)
                        seconds[("get", variant)].append(get_s)
            kind = kv.lane_kind
        total = layout.block_bytes * BATCH
        for op in ("put", "get"):
            gbps = {v: total / statistics.median(seconds[(op, v)]) / 1e9 for v in VARIANTS}
            rows.append(
                {
                    "op": op,
                    "lane": kind,
                    "case": "segments",
                    "segments_per_block": LAYERS,
                    "segment_bytes": layout.layer_bytes,
                    "block_bytes": layout.block_bytes,
                    "batch": BATCH,
                    "reps": reps,
                    **{f"{v}_gbps": round(g, 3) for v, g in gbps.items()},
                    "segments_vs_contiguous": round(gbps["segments"] / gbps["contiguous"], 3),
                    "segments_vs_gather": round(gbps["segments"] / gbps["gather"], 3),
                    "slices_vs_gather": round(gbps["slices"] / gbps["gather"], 3),
                }
            )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    if not rows:  # no lane that takes segments was asked (--lanes grpc)
        return
    print(
        f"\n{LAYERS} segments x {rows[0]['segment_bytes']} B per block, {BATCH} blocks per call\n"
        f"{'op':4} {'lane':5} {'segments':>9} {'slices':>8} {'contig':>8} {'gather':>8} {'seg/contig':>10} "
        f"{'seg/gather':>10} {'slices/gather':>13}  (GB/s)"
    )
    for r in rows:
        print(
            f"{r['op']:4} {r['lane']:5} {r['segments_gbps']:>9.3f} {r['slices_gbps']:>8.3f} "
            f"{r['contiguous_gbps']:>8.3f} {r['gather_gbps']:>8.3f} {r['segments_vs_contiguous']:>10.2f} "
            f"{r['segments_vs_gather']:>10.2f} {r['slices_vs_gather']:>13.2f}"
        )
