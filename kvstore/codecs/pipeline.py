"""Batching and pipelining of block coding for the data path.

Verbs and their promises:

- ``plan_batches(lengths, min_bytes) -> [Batch]``: consecutive runs of blocks
  of at least ``min_bytes`` raw bytes each (the last run may be smaller), in
  order, covering every block once. One codec choice, one worker hand-off and
  one controller observation per batch: per-call overhead dominates small
  blocks (DESIGN 5).
- ``encode_batch(codec, blocks, dtype) -> EncodedBatch``: one payload per
  block, each decodable on its own (the wire and the store keep per-block
  payloads, DESIGN 2.2), with the wall time spent encoding.
- ``iter_encoded(blocks, dtype, choose_codec) -> Iterator[EncodedBatch]``:
  encodes batch i+1 on a worker thread while the caller sends batch i (zstd and
  numpy release the GIL). Batches come out in order; at most ``depth`` encoded
  batches wait in the queue, so memory stays bounded whatever the input size.
  ``choose_codec`` runs on the worker, once per batch, just before encoding.
  An encoder error is raised in the caller at the batch where it happened;
  closing the iterator early stops the worker.
- ``DecodePipeline``: the receiving side's counterpart; ``submit`` hands one
  payload and its destination buffer to a worker thread (blocking while more
  than ``max_pending`` are queued), ``drain`` waits for all of them, raises
  the first error, and returns the decode seconds per codec to report back
  to the sender's controller.

Small blocks (a tiny model's 16 KiB pages) still pay zstd's per-frame cost
because payloads stay per block; real blocks (SmolLM2 360 KiB, Llama-3-8B
2 MiB) are past the point where that matters.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from .base import DEFAULT_HEAD_DIM, EncodeOptions
from .buffers import BufferLike, as_u8, nbytes_of
from .registry import decode_into, get_codec

T = TypeVar("T")

MIN_BATCH_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Batch:
    """Blocks ``start`` .. ``stop - 1`` of the caller's sequence, ``nbytes`` raw bytes in all."""

    start: int
    stop: int
    nbytes: int


@dataclass(slots=True)
class EncodedBatch:
    """The per-block payloads of one batch, all under one codec."""

    start: int
    codec: str
    codec_id: int
    dtype: str
    raw_lengths: list[int]
    payloads: Sequence[bytes | memoryview]  # memoryviews of the caller's blocks when sent raw
    encode_s: float

    @property
    def stop(self) -> int:
        return self.start + len(self.payloads)

    @property
    def raw_bytes(self) -> int:
        return sum(self.raw_lengths)

    @property
    def encoded_bytes(self) -> int:
        return sum(len(p) for p in self.payloads)


def plan_batches(lengths: Sequence[int], min_bytes: int = MIN_BATCH_BYTES) -> list[Batch]:
    """Greedy runs of consecutive blocks holding at least ``min_bytes`` each."""
    batches: list[Batch] = []
    start, acc = 0, 0
    for i, n in enumerate(lengths):
        acc += n
        if acc >= min_bytes:
            batches.append(Batch(start, i + 1, acc))
            start, acc = i + 1, 0
    if start < len(lengths):
        batches.append(Batch(start, len(lengths), acc))
    return batches


def encode_batch(
    codec: str | int,
    blocks: Sequence[BufferLike],
    dtype: str,
    *,
    start: int = 0,
    head_dim: int = DEFAULT_HEAD_DIM,
) -> EncodedBatch:
    """Encode each block of ``blocks`` separately under ``codec``; timed."""
    impl = get_codec(codec)
    opts = EncodeOptions(head_dim=head_dim)
    began = time.perf_counter()
    views = [as_u8(b) for b in blocks]
    payloads = [impl.encode(v, dtype, opts) for v in views]
    elapsed = time.perf_counter() - began
    return EncodedBatch(start, impl.name, impl.id, dtype, [v.nbytes for v in views], payloads, elapsed)


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Done:
    pass


_DONE = _Done()


def iter_encoded(
    blocks: Sequence[BufferLike],
    dtype: str,
    choose_codec: str | Callable[[Batch], str],
    *,
    min_batch_bytes: int = MIN_BATCH_BYTES,
    depth: int = 2,
    head_dim: int = DEFAULT_HEAD_DIM,
) -> Iterator[EncodedBatch]:
    """Encoded batches of ``blocks`` in order, coded one batch ahead on a worker thread.

    ``choose_codec`` is a codec name or a function of the ``Batch`` (typically
    a ``Controller.choose`` closure). ``depth=0`` encodes inline, without a
    thread (same output; for debugging and for callers that already run on a
    worker).
    """
    choose = (lambda _batch: choose_codec) if isinstance(choose_codec, str) else choose_codec
    plan = plan_batches([nbytes_of(b) for b in blocks], min_batch_bytes)

    def encode(batch: Batch) -> EncodedBatch:
        codec = choose(batch)
        return encode_batch(codec, blocks[batch.start : batch.stop], dtype, start=batch.start, head_dim=head_dim)

    return run_ahead((encode(batch) for batch in plan), depth)


def run_ahead(
    source: Iterator[T],
    depth: int,
    on_stall: Callable[[float], None] | None = None,
    spawn: Callable[[Callable[[], None]], None] | None = None,
) -> Iterator[T]:
    """Items of ``source`` in order, produced on a worker thread at most ``depth`` ahead of the consumer.

    An exception in ``source`` is re-raised to the consumer at the item where it
    happened; closing the returned iterator stops the worker. ``on_stall`` gets
    the seconds the consumer waited on an empty queue; ``spawn`` runs the worker
    (default: a new daemon thread). ``depth <= 0`` runs ``source`` inline.
    """
    if depth <= 0:
        yield from source
        return
    ready: queue.Queue[T | _Failed | _Done] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    finished = threading.Event()

    def put(item: T | _Failed | _Done) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, re-raised there
            put(_Failed(exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
            finished.set()

    if spawn is None:
        threading.Thread(target=work, name="kvstore-encode", daemon=True).start()
    else:
        spawn(work)
    try:
        while True:
            try:
                item = ready.get_nowait()
            except queue.Empty:
                began = time.perf_counter()
                item = ready.get()
                if on_stall is not None:
                    on_stall(time.perf_counter() - began)
            if isinstance(item, _Done):
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        stop.set()
        finished.wait()


@dataclass
class DecodeTotals:
    """What a drained ``DecodePipeline`` did, per codec name."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    raw_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    payloads: int = 0


class DecodePipeline:
    """Decode payloads into caller buffers on a worker thread, a bounded number at a time.

    Use as a context manager; ``drain()`` (also called on a clean exit) waits
    for everything submitted so far. Destination buffers must stay alive and
    untouched until ``drain`` returns.
    """

    def __init__(self, max_pending: int = 4):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-decode")
        self._slots = threading.Semaphore(max_pending)
        self._futures: list[Future[None]] = []
        self._totals = DecodeTotals()
        self._lock = threading.Lock()

    def submit(self, codec: str | int, payload: BufferLike, dtype: str, raw_len: int, out: BufferLike) -> None:
        """Queue one decode; blocks while ``max_pending`` decodes are already queued."""
        name = get_codec(codec).name
        self._slots.acquire()

        def run() -> None:
            try:
                began = time.perf_counter()
                decode_into(name, payload, dtype, raw_len, out)
                elapsed = time.perf_counter() - began
                with self._lock:
                    self._totals.seconds[name] += elapsed
                    self._totals.raw_bytes[name] += raw_len
                    self._totals.payloads += 1
            finally:
                self._slots.release()

        self._futures.append(self._pool.submit(run))

    def drain(self) -> DecodeTotals:
        """Wait for every submitted decode; raise the first error; return the totals so far."""
        futures, self._futures = self._futures, []
        first_error: BaseException | None = None
        for fut in futures:
            exc = fut.exception()
            if exc is not None and first_error is None:
                first_error = exc
        if first_error is not None:
            raise first_error
        with self._lock:
            return DecodeTotals(dict(self._totals.seconds), dict(self._totals.raw_bytes), self._totals.payloads)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> DecodePipeline:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                self.drain()
        finally:
            self.close()
