"""Batching, the encoder pipeline and the decode pipeline."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.codecs import CodecError, decode, encode
from kvstore.codecs.controller import Context, Controller, ControllerConfig
from kvstore.codecs.pipeline import (
    MIN_BATCH_BYTES,
    Batch,
    DecodePipeline,
    EncodedBatch,
    encode_batch,
    iter_encoded,
    plan_batches,
)


def blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n * size // 2).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    return [bf16[i * size // 2 : (i + 1) * size // 2] for i in range(n)]


def test_plan_batches_covers_in_order() -> None:
    assert plan_batches([]) == []
    lengths = [100 << 10] * 7 + [3]
    plan = plan_batches(lengths)
    assert plan[0] == Batch(0, 3, 300 << 10)
    assert [b.start for b in plan[1:]] == [b.stop for b in plan[:-1]]
    assert plan[-1].stop == len(lengths) and sum(b.nbytes for b in plan) == sum(lengths)
    assert all(b.nbytes >= MIN_BATCH_BYTES for b in plan[:-1])
    assert [b.stop - b.start for b in plan_batches([2 << 20] * 3)] == [1, 1, 1]


@pytest.mark.parametrize("depth", [0, 2])
def test_iter_encoded_matches_per_block_encode(depth: int) -> None:
    data = blocks(20, 48 << 10)
    seen: list[Batch] = []

    def choose(batch: Batch) -> str:
        seen.append(batch)
        return ["zstd", "byteplane", "none"][len(seen) % 3]

    batches = list(iter_encoded(data, "bfloat16", choose, depth=depth))
    assert [b.start for b in batches] == [b.start for b in seen]
    assert batches[-1].stop == len(data)
    for batch in batches:
        assert isinstance(batch, EncodedBatch) and batch.encode_s >= 0
        assert batch.raw_bytes == sum(d.nbytes for d in data[batch.start : batch.stop])
        for i, payload in enumerate(batch.payloads):
            block = data[batch.start + i]
            assert payload == encode(batch.codec, block, "bfloat16")
            assert decode(batch.codec_id, payload, "bfloat16", block.nbytes) == block.tobytes()


def test_worker_runs_ahead_but_bounded() -> None:
    data = blocks(12, 256 << 10)
    started = threading.Semaphore(0)
    count = {"n": 0}

    def choose(batch: Batch) -> str:
        count["n"] += 1
        started.release()
        return "zstd"

    it = iter_encoded(data, "bfloat16", choose, depth=2)
    first = next(it)
    assert first.start == 0
    # while the caller holds batch 0 the worker encodes batch 1 (the overlap the pipeline exists for)
    assert started.acquire(timeout=5) and started.acquire(timeout=5)
    threading.Event().wait(0.2)
    # ... but no further than the queue depth: 1 consumed + 2 queued + 1 in hand
    assert count["n"] <= 4
    rest = list(it)
    assert len(rest) == 11 and count["n"] == 12


def test_errors_reach_the_caller_and_early_close_stops_worker() -> None:
    data = blocks(8, 256 << 10)

    def choose(batch: Batch) -> str:
        if batch.start == 3:
            raise RuntimeError("controller exploded")
        return "zstd"

    got = []
    with pytest.raises(RuntimeError, match="exploded"):
        for batch in iter_encoded(data, "bfloat16", choose):
            got.append(batch.start)
    assert got == [0, 1, 2]
    with pytest.raises(CodecError):
        list(iter_encoded(data, "int4", "byteplane"))
    before = set(threading.enumerate())
    it = iter_encoded(data, "bfloat16", "zstd", depth=1)
    next(it)
    it.close()
    (worker,) = [t for t in threading.enumerate() if t not in before and t.name == "kvstore-encode"] or [None]
    if worker is not None:  # close() returns once the worker is done: its thread ends right after
        worker.join(10)
        assert not worker.is_alive()


def test_controller_drives_the_pipeline() -> None:
    ctl = Controller(ControllerConfig(seed=0))
    data = blocks(16, 128 << 10)

    def choose(batch: Batch) -> str:
        return ctl.choose(Context("bfloat16", batch.nbytes, pipelined=True))

    for batch in iter_encoded(data, "bfloat16", choose):
        ctx = Context("bfloat16", batch.raw_bytes)
        ctl.observe(batch.codec, ctx, batch.raw_bytes, batch.encoded_bytes, batch.encode_s)
        ctl.observe_transfer(batch.encoded_bytes, batch.encoded_bytes / 1.25e8)
    snap = ctl.snapshot()
    assert sum(v for k, v in snap.items() if k.startswith("codec.choices.")) == 8
    assert snap["codec.zstd.bfloat16.256KiB-1MiB.ratio"] > 1.1


def test_decode_pipeline_into_arena() -> None:
    data = blocks(6, 64 << 10)
    size = data[0].nbytes
    arena = np.zeros(len(data) * size, dtype=np.uint8)
    encoded = encode_batch("byteplane", data, "bfloat16")
    with DecodePipeline(max_pending=2) as pipe:
        for i, payload in enumerate(encoded.payloads):
            pipe.submit("byteplane", payload, "bfloat16", size, arena[i * size : (i + 1) * size])
        totals = pipe.drain()
    assert arena.tobytes() == b"".join(d.tobytes() for d in data)
    assert totals.payloads == 6 and totals.raw_bytes["byteplane"] == 6 * size
    assert totals.seconds["byteplane"] > 0
    with pytest.raises(CodecError):
        with DecodePipeline() as pipe:
            pipe.submit("zstd", b"not a frame", "bfloat16", size, arena[:size])
