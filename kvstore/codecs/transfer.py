"""Codecs on the data path: what the Client and the server do with the codec controller per transfer.

A transfer (one Put stream from a client, one Get stream from the server)
codes its blocks in batches of at least 256 KiB, one codec per batch, the
next batch encoded on a worker thread while the current one is on the wire
(DESIGN 5). Verbs and their promises:

- ``TransferPlan(dtype, codec, controller, lossy_ok, accepted)``: how one
  transfer picks codecs. ``codec`` is a codec name (every batch uses it) or
  ``"auto"`` (``controller.choose`` per batch, with the context's
  constraints: lossy arms only with ``lossy_ok``, only ``accepted`` arms).
  ``choose(batch) -> name``; ``observe(prepared)`` feeds the controller what
  a batch cost to encode and how small it got; ``observe_decode(timings)``
  what the receiver reported for decoding; ``send_clock()`` a ``SendClock``
  that teaches it the link's bandwidth.
- ``prepare(blocks, plan, crcs=None, on_stall=None) -> Iterator[PreparedBatch]``: the
  batches, in order, encoded and checksummed one batch ahead on a worker
  thread: ``pipeline.iter_encoded``'s batching and pipelining, on a worker
  that also checksums, and with a batch under ``none`` left as views of the
  caller's buffers (payloads are bytes, or uint8 arrays for ``none``). Each block's CRC32C is of its raw bytes
  (DESIGN 2.2): taken from ``crcs`` when the caller knows it, else computed;
  under a lossy codec it is of the bytes the receiver will decode (the block
  is decoded here to compute it, ``Codec.encode_decoded``, and that time is
  charged to the codec).
  What a batch cost is the worker thread's CPU time (``time.thread_time``),
  the measure of the controller's priors (bench/codecs.py): wall time would
  add waits for the GIL and the cores, which on a busy host can make a
  codec look several times slower than it is, and keep it unexplored.
  Before the first batch, the worker warms the plan's arms and, for
  ``auto``, calibrates the controller on the first batch (``warmup.py``).
  Workers are long-lived threads shared by every transfer, so the codecs'
  per-thread scratch buffers and contexts stay warm.
  Raw runs skip the worker: when the plan is ``none``, or the controller
  (calibrated already) picks ``none`` for a batch, that batch and the ones
  after it, up to ``RAW_RUN_BYTES``, go raw, prepared inline as the
  consumer asks (one choice per run; a worker hand-off and a choice per
  batch cost a Put of 16 raw blocks 0.6 ms, 10% of its time on an unshaped
  link). The controller is asked again after the run; when it picks a codec
  the rest of the transfer goes to a worker as above.
  Closing the iterator early stops the worker; a worker error is raised in
  the consumer. ``on_stall(seconds)`` hears each time the consumer found no
  batch ready and waited for the encoder.
- ``SendClock`` (``sendclock.py``): the wire time of a stream, for the
  bandwidth estimate. ``prepare`` reports to it when the consumer waited
  for the encoder.
- ``DecodeTally``: decode seconds and bytes per (codec, dtype) on the
  receiving side; ``to_wire()`` / ``from_wire()`` carry it as
  ``kvstore.v1.CodecTiming`` (PutResponse.decode_timings,
  GetRequest.decode_report).
- ``metric_items(prefix, snapshot)``: a controller snapshot as names fit for
  Stats counters and Prometheus (``[a-zA-Z0-9_:]``).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvstore.checksum import crc32c

from .base import DEFAULT_OPTIONS, FLOAT_DTYPES
from .buffers import BufferLike, as_u8, nbytes_of
from .controller import Context, Controller, ControllerConfig
from .pipeline import MIN_BATCH_BYTES, Batch, EncodedBatch, encode_batch, plan_batches, run_ahead
from .registry import codec_names, get_codec
from .sendclock import SendClock
from .warmup import calibrate, calibrated, cost_clock, warm_up

if TYPE_CHECKING:  # imported where used: the codecs load the wire messages only for the timings
    from kvstore.v1 import kvstore_pb2 as pb

AUTO = "auto"
BANDWIDTH_ALPHA = 0.5  # one sample per Put stream: halve the log error each Put, so a changed link is followed in 3-4
RAW_RUN_BYTES = 8 << 20  # a run of raw batches asks the controller again after this many bytes
EPSILON, EXPLORE_WITHIN = 0.01, 2.0  # exploration costs at most 1% x (2 - 1) of a transfer: the model, not
# exploration, follows the bandwidth; exploring 3% of batches within 3x cost up to 6% of every transfer


def default_arms() -> tuple[str, ...]:
    """Every registered codec but lz4, which gains nothing on dense KV (ratio 1.00, bench/results/codecs.json)."""
    return tuple(name for name in codec_names() if name != "lz4")


def transfer_config() -> ControllerConfig:
    """The controller settings of the data path: ``default_arms``, the bandwidth weight and exploration above."""
    return ControllerConfig(
        arms=default_arms(), bandwidth_alpha=BANDWIDTH_ALPHA, epsilon=EPSILON, explore_within=EXPLORE_WITHIN
    )


def codable(dtype: str) -> bool:
    """Whether blocks of ``dtype`` can be coded (the codecs know float element types only)."""
    return dtype in FLOAT_DTYPES


@dataclass(slots=True)
class PreparedBatch:
    """One encoded batch with the raw CRC32C of each block and what preparing it cost."""

    encoded: EncodedBatch
    crcs: list[int]
    context: Context
    prepare_s: float  # CPU seconds: encoding, plus the local decode of a lossy codec's CRC


@dataclass
class TransferPlan:
    """How one transfer picks a codec per batch; see the module docstring."""

    dtype: str
    codec: str = AUTO
    controller: Controller | None = None
    lossy_ok: bool = False
    accepted: frozenset[str] | None = None
    stream_bytes: int = 0  # raw bytes of the whole transfer, set by ``prepare`` (the cost model's fill/drain)

    def __post_init__(self) -> None:
        if self.codec == AUTO and self.controller is None:
            raise ValueError("codec 'auto' needs a controller")
        if self.codec != AUTO:
            self.codec = get_codec(self.codec).name

    def arms(self) -> list[str]:
        """The codecs this plan may pick."""
        if self.codec != AUTO:
            return [self.codec]
        assert self.controller is not None
        return self.controller.allowed(self.context(MIN_BATCH_BYTES))

    def context(self, nbytes: int) -> Context:
        return Context(self.dtype, nbytes, True, self.lossy_ok, self.accepted, self.stream_bytes)

    def choose(self, batch: Batch) -> str:
        if self.codec != AUTO:
            return self.codec
        assert self.controller is not None
        return self.controller.choose(self.context(batch.nbytes))

    def observe(self, prepared: PreparedBatch) -> None:
        if self.controller is None:
            return
        enc = prepared.encoded
        self.controller.observe(enc.codec, prepared.context, enc.raw_bytes, enc.encoded_bytes, prepared.prepare_s)

    def observe_decode(self, timings: Iterable[CodecTiming]) -> None:
        observe_decode(self.controller, timings)

    def send_clock(self) -> SendClock:
        """A clock for one stream of this plan, reporting to its controller (to nobody without one)."""
        if self.controller is None:
            return SendClock(lambda _n, _s: None)
        ctl = self.controller
        return SendClock(ctl.observe_transfer, ctl.measured_bandwidth_bps)


@dataclass(frozen=True, slots=True)
class CodecTiming:
    """What decoding ``blocks`` blocks (``raw_bytes``) of one codec and dtype cost a receiver."""

    codec: str
    dtype: str
    raw_bytes: int
    blocks: int
    seconds: float


def observe_decode(controller: Controller | None, timings: Iterable[CodecTiming]) -> None:
    """Feed a receiver's decode report to ``controller``, sized like the transfer's batches."""
    if controller is None:
        return
    for t in timings:
        if t.raw_bytes <= 0 or t.blocks <= 0 or t.codec not in controller.arms:
            continue
        per_block = t.raw_bytes / t.blocks
        nbytes = int(min(t.raw_bytes, max(per_block, MIN_BATCH_BYTES)))  # a batch's size class
        controller.observe_decode(t.codec, Context(t.dtype, nbytes), nbytes, t.seconds * nbytes / t.raw_bytes)


@dataclass
class DecodeTally:
    """Decode time per (codec, dtype) on a receiver; thread-safe."""

    _rows: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, codec: str | int, dtype: str, raw_bytes: int, seconds: float, blocks: int = 1) -> None:
        key = (get_codec(codec).name, dtype)
        with self._lock:
            row = self._rows.setdefault(key, [0.0, 0.0, 0.0])
            row[0] += raw_bytes
            row[1] += blocks
            row[2] += seconds

    def timings(self) -> list[CodecTiming]:
        with self._lock:
            return [CodecTiming(c, d, int(r[0]), int(r[1]), r[2]) for (c, d), r in self._rows.items()]

    def take(self) -> list[CodecTiming]:
        """The timings so far, leaving the tally empty."""
        with self._lock:
            rows, self._rows = self._rows, {}
        return [CodecTiming(c, d, int(r[0]), int(r[1]), r[2]) for (c, d), r in rows.items()]

    @staticmethod
    def to_wire(timings: Iterable[CodecTiming]) -> list[pb.CodecTiming]:
        from kvstore.v1 import kvstore_pb2 as pb

        return [
            pb.CodecTiming(
                # protoc's .pyi types an enum field as Codec | str; protobuf takes (and stores) the int
                codec=get_codec(t.codec).id,  # type: ignore[arg-type]
                dtype=t.dtype,
                raw_bytes=t.raw_bytes,
                blocks=t.blocks,
                seconds=t.seconds,
            )
            for t in timings
        ]

    @staticmethod
    def from_wire(messages: Iterable[pb.CodecTiming]) -> list[CodecTiming]:
        out: list[CodecTiming] = []
        for m in messages:
            try:
                name = get_codec(int(m.codec)).name
            except ValueError:  # a codec this build does not know: nothing to learn
                continue
            if m.seconds >= 0.0 and m.raw_bytes > 0:
                out.append(CodecTiming(name, m.dtype, int(m.raw_bytes), max(int(m.blocks), 1), float(m.seconds)))
        return out


# ---------------------------------------------------------------------------------- encoding


def prepare(
    blocks: Sequence[BufferLike],
    plan: TransferPlan,
    crcs: Sequence[int | None] | None = None,
    *,
    on_stall: Callable[[float], None] | None = None,
    depth: int = 2,
    min_batch_bytes: int = MIN_BATCH_BYTES,
) -> Generator[PreparedBatch, None, None]:
    """Encoded, checksummed batches of ``blocks`` in order: raw runs inline, coded ones one batch ahead on a
    worker thread (see the module docstring)."""
    sizes = [nbytes_of(b) for b in blocks]
    plan.stream_bytes = sum(sizes)
    return _stream(blocks, sizes, plan_batches(sizes, min_batch_bytes), plan, crcs, on_stall, depth)


def _stream(
    blocks: Sequence[BufferLike],
    sizes: list[int],
    batches: list[Batch],
    plan: TransferPlan,
    crcs: Sequence[int | None] | None,
    on_stall: Callable[[float], None] | None,
    depth: int,
) -> Generator[PreparedBatch, None, None]:
    i = 0
    while i < len(batches):
        raw, first = _raw_next(plan, sizes, batches[i], blocks)
        if not raw:
            yield from run_ahead(
                _produce(blocks, sizes, batches[i:], first, plan, crcs), depth, on_stall, spawn=_WORKERS.run
            )
            return
        j, run = i + 1, batches[i].nbytes
        while j < len(batches) and run < RAW_RUN_BYTES:
            run += batches[j].nbytes
            j += 1
        if plan.codec == AUTO and plan.controller is not None:
            plan.controller.count("none", j - i - 1)  # batch i was chosen; the rest of the run follows it
        for batch in batches[i:j]:
            views = [as_u8(b) for b in blocks[batch.start : batch.stop]]
            known = crcs[batch.start : batch.stop] if crcs is not None else [None] * len(views)
            sums = [c if c is not None else crc32c(v) for c, v in zip(known, views)]
            enc = EncodedBatch(
                batch.start, "none", 0, plan.dtype, [v.nbytes for v in views], [v.data for v in views], 0.0
            )
            yield PreparedBatch(enc, sums, plan.context(batch.nbytes), 0.0)
        i = j


def _raw_next(
    plan: TransferPlan, sizes: list[int], batch: Batch, blocks: Sequence[BufferLike]
) -> tuple[bool, str | None]:
    """Whether the run of batches from ``batch`` goes raw, inline, and the codec already chosen for it."""
    if plan.codec == "none":
        return True, None
    if plan.codec != AUTO or plan.controller is None or not calibrated(plan.controller, plan.arms(), plan.dtype):
        return False, None  # coding, or a first transfer: the worker calibrates, then chooses
    first = plan.choose(batch)
    return first == "none", first


def _produce(
    blocks: Sequence[BufferLike],
    sizes: list[int],
    batches: list[Batch],
    first: str | None,
    plan: TransferPlan,
    crcs: Sequence[int | None] | None,
) -> Iterator[PreparedBatch]:
    """The worker's side: calibrate and warm up (once), then encode and checksum ``batches`` in order."""
    arms = plan.arms()
    if plan.codec == AUTO and plan.controller is not None and batches:  # warms what it codes
        head = batches[0]
        calibrate(plan.controller, arms, plan.dtype, blocks[head.start : head.stop], plan.context(head.nbytes))
    warm_up(arms, plan.dtype, max(sizes, default=0))
    encoded = _encoded(blocks, batches, first, plan)
    while True:
        cpu = cost_clock()
        step = next(encoded, None)
        if step is None:
            return
        enc, sums = step
        encode_cpu = cost_clock() - cpu  # a lossy codec's: with the decode its CRC needs
        if sums is None:
            sums = []
            for j in range(len(enc.payloads)):
                known = crcs[enc.start + j] if crcs is not None else None
                sums.append(known if known is not None else crc32c(as_u8(blocks[enc.start + j])))
        prepared = PreparedBatch(enc, sums, plan.context(enc.raw_bytes), encode_cpu)
        plan.observe(prepared)
        yield prepared


def _encoded(
    blocks: Sequence[BufferLike], batches: list[Batch], first: str | None, plan: TransferPlan
) -> Iterator[tuple[EncodedBatch, list[int] | None]]:
    """``pipeline.iter_encoded`` inline (we are on the worker already), with ``none`` batches left uncopied;
    ``first``: the codec already chosen for the first batch. With each batch, a lossy codec's CRC32Cs (of
    what the receiver will decode); None: the raw bytes' CRCs are wanted."""
    for k, batch in enumerate(batches):
        codec = first if k == 0 and first is not None else plan.choose(batch)
        part = blocks[batch.start : batch.stop]
        if codec == "none":  # raw bytes go as they are: views of the caller's buffers, no copy
            views = [as_u8(b) for b in part]
            yield (
                EncodedBatch(
                    batch.start, "none", 0, plan.dtype, [v.nbytes for v in views], [v.data for v in views], 0.0
                ),
                None,
            )
        elif get_codec(codec).lossy:
            impl, views = get_codec(codec), [as_u8(b) for b in part]
            began, payloads, sums = time.perf_counter(), [], []
            for v in views:
                out = np.empty(v.nbytes, dtype=np.uint8)
                payloads.append(impl.encode_decoded(v, plan.dtype, DEFAULT_OPTIONS, out))
                sums.append(crc32c(out))
            yield (
                EncodedBatch(
                    batch.start,
                    impl.name,
                    impl.id,
                    plan.dtype,
                    [v.nbytes for v in views],
                    payloads,
                    time.perf_counter() - began,
                ),
                sums,
            )
        else:
            yield encode_batch(codec, part, plan.dtype, start=batch.start), None


class _Workers:
    """Long-lived worker threads shared by every transfer of the process; more are started when all are busy.

    The codecs keep per-thread scratch buffers and zstd contexts: a thread per
    transfer would page-fault its buffers in again on every Put (several
    times the arithmetic for fp8) and teach the controller a cold cost.
    """

    def __init__(self, max_idle: int = 8):
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._max_idle = max_idle

    def run(self, fn: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(inbox,), name="kvstore-prepare", daemon=True).start()
        inbox.put(fn)

    def _loop(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()
            with self._lock:
                if len(self._idle) >= self._max_idle:
                    return
                self._idle.append(inbox)


_WORKERS = _Workers()


_METRIC_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def metric_items(prefix: str, snapshot: dict[str, float]) -> dict[str, float]:
    """``snapshot`` keys (``codec.fp8+zstd.bfloat16.256KiB-1MiB.ratio``) as metric names under ``prefix``."""
    out = {}
    for key, value in snapshot.items():
        name = _METRIC_CHARS.sub("_", key.removeprefix("codec.").replace("+", "_"))
        out[f"{prefix}{name}"] = float(value)
    return out
