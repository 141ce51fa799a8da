"""The store node's side of coded transfers: the Get controller and the codec counters.

``ServerCoding(metrics, lossy, codec="auto")`` is one per node. Verbs and promises:

- ``begin_get(namespace, accepted_ids) -> GetTransfer | None``: None when the
  reader accepts nothing but ``none`` (the Get runs as before). Otherwise a
  transfer whose codec per batch is the node-wide controller's choice among
  the reader's accepted codecs (or the node's fixed ``--get-codec`` when the
  reader accepts it, else ``none``); lossy codecs only when the reader
  accepts one and the namespace's ``LossyPolicy`` allows lossy KV.
- ``GetTransfer.messages(window, chunk_bytes) -> Iterator[GetResponse]``: the
  window's blocks in order. A block stored under a codec the reader accepts
  goes as stored; a raw block of a float dtype (or one stored under a codec
  the reader cannot decode, decoded first) is coded in batches, one batch
  ahead of the wire (``transfer.prepare``); other blocks go raw. Headers keep
  the raw bytes' CRC32C (of the decoded bytes under a lossy codec). The send
  time of every message feeds the controller's bandwidth estimate
  (``SendClock``).
- ``GetTransfer.close()``: the last bandwidth sample, then the counters.
- ``observe_report(timings)``: a reader's decode times (``GetRequest.
  decode_report``, for its earlier Gets) teach the controller decode cost.
- ``put_decoded(tally)``: what verifying a Put's encoded blocks cost (the
  store decodes each to check its CRC32C; DESIGN 2.2).

Counters (Stats.counters and /metrics): ``codec_get_*`` from the controller's
``snapshot()`` (``codec_get_bandwidth_bps``, ``codec_get_choices_<arm>`` per
batch, ratio and GB/s estimates per arm, dtype and size class),
``codec_get_blocks_<codec>`` blocks sent per codec, ``codec_put_blocks_<codec>``
and ``codec_put_decode_seconds_<codec>`` for encoded blocks received.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvstore.v1 import kvstore_pb2 as pb

from .base import FLOAT_DTYPES
from .buffers import as_u8
from .controller import Controller, ControllerConfig
from .policy import LossyPolicy
from .registry import codec_names, decode, get_codec
from .sendclock import SendClock
from .transfer import AUTO, DecodeTally, TransferPlan, codable, metric_items, observe_decode, prepare, transfer_config
from .verify import verify_crc
from .warmup import cost_clock, warm_up

WARM_BYTES = 64 << 10


class ServerCoding:
    """The node-wide Get controller, the namespace lossy policy, and the codec counters."""

    def __init__(
        self, metrics: Any, lossy: LossyPolicy | None = None, codec: str = AUTO, config: ControllerConfig | None = None
    ):
        self.metrics, self.lossy = metrics, lossy or LossyPolicy()
        self.codec = codec if codec == AUTO else get_codec(codec).name
        self.controller = Controller(config or transfer_config())
        for dtype in FLOAT_DTYPES:  # one-time decoder costs (imports, tables) before the first Put
            warm_up(codec_names(), dtype, WARM_BYTES)

    def begin_get(self, namespace: str, accepted_ids: Iterable[int]) -> GetTransfer | None:
        names = {"none"}
        for wire_id in accepted_ids:
            try:
                names.add(get_codec(int(wire_id)).name)
            except ValueError:  # a newer reader's codec: not ours to send
                continue
        if names == {"none"}:
            return None
        lossy_ok = self.lossy.allows(namespace) and any(get_codec(n).lossy for n in names)
        if not lossy_ok:
            names = {n for n in names if not get_codec(n).lossy}
        return GetTransfer(self, frozenset(names), lossy_ok)

    def observe_report(self, messages: Iterable[Any]) -> None:
        observe_decode(self.controller, DecodeTally.from_wire(messages))

    def verify(self, meta: Any, stored: Any, stored_crc: int, tally: DecodeTally) -> bool:
        """``verify_crc`` of a Put block; an encoded block's decode is timed (thread CPU) into ``tally``."""
        if meta.codec == pb.CODEC_NONE:
            return verify_crc(meta, stored, stored_crc)
        name = get_codec(meta.codec).name
        warm_up([name], meta.dtype, meta.raw_length)  # this handler thread's scratch buffers, not the sender's bill
        began = cost_clock()
        ok = verify_crc(meta, stored, stored_crc)
        tally.add(name, meta.dtype, meta.raw_length, cost_clock() - began)
        return ok

    def put_decoded(self, tally: DecodeTally) -> None:
        for t in tally.timings():
            self.metrics.add(f"codec_put_blocks_{_metric(t.codec)}", float(t.blocks))
            self.metrics.add(f"codec_put_decode_seconds_{_metric(t.codec)}", t.seconds)

    def publish(self, sent: Counter[str]) -> None:
        for name, value in metric_items("codec_get_", self.controller.snapshot()).items():
            self.metrics.set(name, value)
        for codec, blocks in sent.items():
            self.metrics.add(f"codec_get_blocks_{_metric(codec)}", float(blocks))


def _metric(codec: str) -> str:
    return codec.replace("+", "_")


class GetTransfer:
    """One Get stream's coding; see the module docstring."""

    def __init__(self, coding: ServerCoding, accepted: frozenset[str], lossy_ok: bool):
        self.coding, self.accepted, self.lossy_ok = coding, accepted, lossy_ok
        ctl = coding.controller
        self.clock = SendClock(ctl.observe_transfer, lambda: ctl.bandwidth_bps)
        self.sent: Counter[str] = Counter()
        self._accepted_ids = {get_codec(n).id for n in accepted}
        self._window_done: float | None = None  # when the last window's messages were all taken

    def plan(self, dtype: str) -> TransferPlan:
        codec = self.coding.codec
        if codec != AUTO and codec not in self.accepted:
            codec = "none"
        return TransferPlan(dtype, codec, self.coding.controller, self.lossy_ok, self.accepted)

    def messages(self, window: Sequence[Any], chunk_bytes: int) -> Iterator[pb.GetResponse]:
        if self._window_done is not None:  # reading this window from the store was not wire time
            self.clock.stalled(time.perf_counter() - self._window_done)
        yield from self._window(window, chunk_bytes)
        self._window_done = time.perf_counter()

    def _window(self, window: Sequence[Any], chunk_bytes: int) -> Iterator[pb.GetResponse]:
        run: list[tuple[Any, Any]] = []  # (lease, raw bytes) of consecutive blocks to code under one dtype
        for lease in window:
            if lease is not None and self._to_code(lease):
                raw = (
                    lease.buffer
                    if lease.codec == pb.CODEC_NONE
                    else decode(lease.codec, lease.buffer, lease.dtype, lease.raw_length)
                )
                if run and run[0][0].dtype != lease.dtype:
                    yield from self._coded(run, chunk_bytes)
                    run = []
                run.append((lease, raw))
                continue
            if run:
                yield from self._coded(run, chunk_bytes)
                run = []
            yield from self._as_stored(lease, chunk_bytes)
        if run:
            yield from self._coded(run, chunk_bytes)

    def close(self) -> None:
        self.clock.finish()
        self.coding.publish(self.sent)

    # -- helpers ------------------------------------------------------------------------------
    def _to_code(self, lease: Any) -> bool:
        stored_ok = lease.codec != pb.CODEC_NONE and lease.codec in self._accepted_ids
        return not stored_ok and codable(lease.dtype)

    def _coded(self, run: list[tuple[Any, Any]], chunk_bytes: int) -> Iterator[pb.GetResponse]:
        leases = [lease for lease, _ in run]
        plan = self.plan(leases[0].dtype)
        crcs = [lease.crc32c for lease in leases]
        for prepared in prepare([as_u8(raw) for _, raw in run], plan, crcs, on_stall=self.clock.stalled):
            enc = prepared.encoded
            self.clock.begin()
            for j, payload in enumerate(enc.payloads):
                lease = leases[enc.start + j]
                header = pb.BlockHeader(
                    hash=lease.hash,
                    codec=enc.codec_id,  # type: ignore[arg-type]  # protoc's .pyi: Codec | str; an int is what it takes
                    raw_length=enc.raw_lengths[j],
                    stored_length=len(payload),
                    crc32c=prepared.crcs[j],
                    dtype=lease.dtype,
                )
                yield from _chunked(header, memoryview(payload), chunk_bytes)
            self.clock.sent(enc.encoded_bytes)
            self.sent[enc.codec] += len(enc.payloads)

    def _as_stored(self, lease: Any, chunk_bytes: int) -> Iterator[pb.GetResponse]:
        if lease is None:
            yield pb.GetResponse(header=pb.BlockHeader(missing=True))
            return
        codec, stored, buf = lease.codec, lease.stored_length, lease.buffer
        if codec not in self._accepted_ids:  # stored encoded, not codable here (dtype): send it decoded
            buf = decode(codec, buf, lease.dtype, lease.raw_length)
            codec, stored = pb.CODEC_NONE, lease.raw_length
        header = pb.BlockHeader(
            hash=lease.hash,
            codec=codec,
            raw_length=lease.raw_length,
            stored_length=stored,
            crc32c=lease.crc32c,
            dtype=lease.dtype,
        )
        self.clock.begin()
        yield from _chunked(header, as_u8(buf).data[:stored], chunk_bytes)
        self.clock.sent(stored)
        self.sent[get_codec(codec).name] += 1


def _chunked(header: pb.BlockHeader, data: memoryview, chunk_bytes: int) -> Iterator[pb.GetResponse]:
    n = len(data)
    yield pb.GetResponse(header=header, data=bytes(data[: min(chunk_bytes, n)]))
    for start in range(chunk_bytes, n, chunk_bytes):
        yield pb.GetResponse(data=bytes(data[start : start + chunk_bytes]))
