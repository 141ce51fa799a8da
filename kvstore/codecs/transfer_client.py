"""The Client's side of coded transfers: Put streams it encodes, Get streams it decodes.

``ClientCoding(codec)`` is one per ``kvstore.client.Client``. Verbs and promises:

- ``put_plan(codec, dtype, lossy_ok, lossy_allowed) -> TransferPlan | None``:
  how a Put codes its blocks, or None when it sends them raw (codec
  ``none``, or a dtype the codecs do not know, e.g. plain bytes). ``auto``
  uses this client's controller; lossy arms only when the caller says the
  namespace may hold lossy KV (``lossy_ok``) and ``lossy_allowed()`` (the
  server's policy for the namespace) agrees. A fixed lossy codec without
  ``lossy_ok`` is a ValueError: lossy KV is never sent by accident.
- ``put_requests(namespace, hashes, parents, blocks, plan, clock, chunk_bytes)``:
  the Put stream: per block a header (codec, raw and stored lengths, the raw
  CRC32C) and chunks of at most ``chunk_bytes``, batches encoded one ahead
  of the wire; the clock sees each batch's send time. An encoder error ends
  the stream at a block boundary and is appended to ``errors`` for the
  caller to raise once the reply is in.
- ``accepted(codec, lossy_ok) -> [wire ids]``: what a Get may receive coded
  (empty for ``none``: the server sends raw bytes, on any lane).
- ``receive(messages, count, out, verify) -> [payload | None]``: a Get
  stream's blocks in order, decoded (on a worker thread, overlapping the
  receipt of the next blocks) into ``out`` buffers when given, else into new
  ones; every block's CRC32C of its raw bytes is checked after decoding
  (DATA_LOSS on a mismatch). What decoding cost is kept and sent with the
  next Get (``take_report()``) so the server's controller learns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.checksum import crc32c
from kvstore.errors import KVStoreError
from kvstore.payload import as_bytes_view
from kvstore.v1 import kvstore_pb2 as pb

from .buffers import as_writable_u8
from .controller import Controller, ControllerConfig
from .pipeline import DecodePipeline
from .registry import codec_names, get_codec
from .sendclock import SendClock
from .transfer import AUTO, DecodeTally, TransferPlan, codable, prepare, transfer_config

ViewOf = Callable[[Any], tuple[memoryview, str]]  # payload -> (flat byte view, dtype name): as_bytes_view


class ClientCoding:
    """A client's default codec, its controller (made on first use) and its pending decode report."""

    def __init__(self, codec: str = "none", config: ControllerConfig | None = None):
        self.codec = check_codec(codec)
        self._config = config
        self._controller: Controller | None = None
        self.report = DecodeTally()

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            self._controller = Controller(self._config or transfer_config())
        return self._controller

    def put_plan(
        self, codec: str | None, dtype: str, lossy_ok: bool, lossy_allowed: Callable[[], bool]
    ) -> TransferPlan | None:
        codec = self.codec if codec is None else check_codec(codec)
        if codec == "none" or not codable(dtype):
            return None
        if codec == AUTO:
            return TransferPlan(dtype, AUTO, self.controller, lossy_ok=lossy_ok and lossy_allowed())
        if get_codec(codec).lossy and not lossy_ok:
            raise ValueError(f"codec {codec} is lossy: pass lossy_ok=True only for a namespace whose KV may be lossy")
        return TransferPlan(dtype, codec)

    def accepted(self, codec: str | None, lossy_ok: bool) -> list[int]:
        codec = self.codec if codec is None else check_codec(codec)
        if codec == "none":
            return []
        names = codec_names(lossy=None if lossy_ok else False) if codec == AUTO else [codec]
        if codec != AUTO and get_codec(codec).lossy and not lossy_ok:
            raise ValueError(f"codec {codec} is lossy: pass lossy_ok=True to receive lossy KV")
        return sorted({get_codec(n).id for n in names} - {pb.CODEC_NONE})

    def take_report(self) -> list[pb.CodecTiming]:
        return DecodeTally.to_wire(self.report.take())

    # -- put ------------------------------------------------------------------------------------
    def put_requests(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        parents: Sequence[bytes],
        blocks: Sequence[Any],
        plan: TransferPlan,
        clock: SendClock,
        chunk_bytes: int,
        errors: list[BaseException],
    ) -> Iterator[pb.PutRequest]:
        first = True
        stream = prepare(blocks, plan, on_stall=clock.stalled)
        try:
            while True:
                try:
                    prepared = next(stream)
                except StopIteration:
                    return
                except Exception as err:  # the encoder failed: end the stream here, raise after the reply
                    errors.append(err)
                    return
                enc = prepared.encoded
                clock.begin()
                for j, payload in enumerate(enc.payloads):
                    i = enc.start + j
                    header = pb.BlockHeader(
                        hash=hashes[i],
                        parent=parents[i],
                        codec=enc.codec_id,  # type: ignore[arg-type]  # protoc's .pyi: Codec | str; an int is what it takes
                        raw_length=enc.raw_lengths[j],
                        stored_length=len(payload),
                        crc32c=prepared.crcs[j],
                        dtype=plan.dtype,
                    )
                    view = memoryview(payload)
                    whole = payload if isinstance(payload, bytes) and len(payload) <= chunk_bytes else None
                    yield pb.PutRequest(
                        namespace=namespace if first else "",
                        header=header,
                        data=whole if whole is not None else bytes(view[:chunk_bytes]),
                    )
                    first = False
                    for start in range(chunk_bytes, len(view), chunk_bytes):
                        yield pb.PutRequest(data=bytes(view[start : start + chunk_bytes]))
                clock.sent(enc.encoded_bytes)
        finally:
            stream.close()

    # -- get ------------------------------------------------------------------------------------
    def receive(
        self, messages: Iterator[pb.GetResponse], count: int, out: Sequence[Any] | None, verify: bool
    ) -> list[Any]:
        results: list[Any] = []
        coded: list[tuple[int, pb.BlockHeader, Any]] = []  # (index, header, destination) decoded on the worker
        header: pb.BlockHeader | None = None
        buf: memoryview | None = None
        filled = 0
        with DecodePipeline() as decoder:
            for msg in messages:
                if msg.HasField("header"):
                    header, filled = msg.header, 0
                    if header.missing:
                        results.append(None)
                        header = None
                        continue
                    buf = _landing(header, out, len(results), as_bytes_view)
                if header is None:
                    continue
                assert buf is not None
                buf[filled : filled + len(msg.data)] = msg.data
                filled += len(msg.data)
                if filled < header.stored_length:
                    continue
                index = len(results)
                if header.codec == pb.CODEC_NONE:
                    if verify and crc32c(buf[: header.raw_length]) != header.crc32c:
                        raise KVStoreError(
                            grpc.StatusCode.DATA_LOSS, f"block {index} ({header.hash.hex()}) failed its CRC32C check"
                        )
                    results.append(out[index] if out is not None else buf)
                else:
                    dest = _destination(header, out, index, as_bytes_view)
                    decoder.submit(header.codec, buf, header.dtype, header.raw_length, dest)
                    coded.append((index, header, dest))
                    results.append(out[index] if out is not None else dest)
                header = None
            totals = decoder.drain()
        if len(results) != count:
            raise KVStoreError(grpc.StatusCode.DATA_LOSS, f"stream ended after {len(results)} of {count} blocks")
        self._tally(coded, totals)
        if verify:
            for index, h, dest in coded:
                if crc32c(dest[: h.raw_length]) != h.crc32c:
                    raise KVStoreError(
                        grpc.StatusCode.DATA_LOSS,
                        f"block {index} ({h.hash.hex()}) failed its CRC32C "
                        f"check after decoding {get_codec(h.codec).name}",
                    )
        return results

    def _tally(self, coded: list[tuple[int, pb.BlockHeader, Any]], totals: Any) -> None:
        blocks: dict[str, tuple[str, int]] = {}
        for _, h, _ in coded:
            name = get_codec(h.codec).name
            dtype, n = blocks.get(name, (h.dtype, 0))
            blocks[name] = (dtype, n + 1)
        for name, (dtype, n) in blocks.items():
            self.report.add(name, dtype, int(totals.raw_bytes.get(name, 0)), totals.seconds.get(name, 0.0), n)


def check_codec(codec: str) -> str:
    """``auto`` or a registered codec's name; ValueError otherwise."""
    if codec == AUTO:
        return codec
    return get_codec(codec).name


def _landing(header: pb.BlockHeader, out: Sequence[Any] | None, index: int, view_of: ViewOf) -> memoryview:
    """Where a block's stored bytes land: the caller's buffer for raw blocks, else a new buffer."""
    n = header.stored_length
    if header.codec == pb.CODEC_NONE and out is not None:
        dest = view_of(out[index])[0]
        if len(dest) < n:
            raise ValueError(f"output buffer {index} holds {len(dest)} bytes; block is {n}")
        return dest
    return memoryview(bytearray(n))


def _destination(header: pb.BlockHeader, out: Sequence[Any] | None, index: int, view_of: ViewOf) -> Any:
    """Where a coded block decodes to: the caller's buffer, else a new one of raw_length bytes."""
    if out is None:
        return np.empty(header.raw_length, dtype=np.uint8).data
    dest = view_of(out[index])[0]
    if len(dest) < header.raw_length:
        raise ValueError(f"output buffer {index} holds {len(dest)} bytes; block is {header.raw_length}")
    as_writable_u8(dest)  # refuse a read-only destination before the worker writes to it
    return dest
