"""The receiving end of a gRPC Get stream of raw blocks (``NodeClient``'s Gets that no lane served).

``receive_blocks(stream, count, out, verify) -> [block | None]``: each block, in request order, arrives either as
a header with its first chunk then chunks of data only, or, when the request asked for ``packed``, as one of the
whole blocks of a message (``GetResponse.blocks``, their bytes one after another in ``data``). Into ``out`` when
given (numpy or bytes-like buffers, or ``Segments`` scattered as chunks arrive), else each block's own bytes;
with ``verify`` every raw block's CRC32C is checked (DATA_LOSS naming the block when one differs). The messages
are ``block_messages.decode_get``'s (``data`` a view of the bytes gRPC received): ``get_call(channel)`` is the Get call that
gives them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from kvstore import block_messages
from kvstore.checksum import crc32c
from kvstore.errors import KVStoreError, corrupt_block
from kvstore.memops import copy_crc
from kvstore.payload import Segments, SegmentsWriter, as_bytes_view
from kvstore.v1 import kvstore_pb2 as pb

GET_METHOD = "/" + pb.DESCRIPTOR.services_by_name["KVStore"].full_name + "/Get"


def get_call(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable[pb.GetRequest, block_messages.GetMessage]:
    """KVStore.Get whose responses are ``block_messages.GetMessage``s, where the stub's are parsed protobuf objects."""
    return channel.unary_stream(
        GET_METHOD, request_serializer=pb.GetRequest.SerializeToString, response_deserializer=block_messages.decode_get
    )


def receive_blocks(
    stream: Iterable[block_messages.GetMessage], count: int, out: Sequence[Any] | None, verify: bool
) -> list[Any]:
    results: list[Any] = []
    header: pb.BlockHeader | None = None
    dest: Any = None
    single: memoryview | None = None
    filled = 0
    for msg in stream:
        if msg.blocks:
            if header is not None:
                raise KVStoreError(grpc.StatusCode.DATA_LOSS, f"block {len(results)} ended before its last chunk")
            _take_packed(msg, results, out, verify)
            continue
        if msg.header is not None:
            header = msg.header
            if header.missing:
                results.append(None)
                header = None
                continue
            n = header.stored_length
            filled, single = 0, None
            if out is not None and isinstance(out[len(results)], Segments):
                dest = SegmentsWriter(out[len(results)], n)  # chunks scattered as they arrive
            elif out is not None:
                dest = _out_view(out, len(results), n)
            elif len(msg.data) == n:
                dest, single = None, msg.data  # whole block in one message: keep it, no copy
            else:
                dest = memoryview(bytearray(n))
        if header is None:
            continue
        if single is None and msg.data:
            assert dest is not None
            dest[filled : filled + len(msg.data)] = msg.data
        filled += len(msg.data)
        if filled == header.stored_length:
            block = single if single is not None else (out[len(results)] if out is not None else dest)
            if verify and header.codec == pb.CODEC_NONE:
                if isinstance(dest, SegmentsWriter):
                    crc = dest.crc32c()
                elif single is not None:
                    crc = crc32c(single)
                else:
                    assert dest is not None  # a block not whole in one message lands in dest
                    crc = crc32c(dest[: header.stored_length])
                if crc != header.crc32c:
                    raise corrupt_block(len(results), header.hash)
            results.append(block)
            header = None
    if len(results) != count:
        raise KVStoreError(grpc.StatusCode.DATA_LOSS, f"stream ended after {len(results)} of {count} blocks")
    return results


def _take_packed(msg: block_messages.GetMessage, results: list[Any], out: Sequence[Any] | None, verify: bool) -> None:
    """The whole blocks of one packed message, in order: each copied into its buffer with its CRC32C in one pass,
    or, without ``out``, a view of the message's bytes (no copy)."""
    data = msg.data
    at = 0
    for h in msg.blocks:
        i = len(results)
        if h.missing:
            results.append(None)
            continue
        n = h.stored_length
        part = data[at : at + n]
        at += n
        if len(part) != n:
            raise KVStoreError(grpc.StatusCode.DATA_LOSS, f"block {i}: a packed message holds fewer bytes than named")
        check = verify and h.codec == pb.CODEC_NONE
        if out is None:
            crc = crc32c(part) if check else h.crc32c
            block: Any = part
        elif isinstance(out[i], Segments):
            writer = SegmentsWriter(out[i], n)
            writer[0:n] = part
            crc = writer.crc32c() if check else h.crc32c
            block = out[i]
        else:
            crc = copy_crc(_out_view(out, i, n), part)
            block = out[i]
        if check and crc != h.crc32c:
            raise corrupt_block(i, h.hash)
        results.append(block)
    if at != len(data):
        raise KVStoreError(grpc.StatusCode.DATA_LOSS, "a packed message holds more bytes than its blocks")


def _out_view(out: Sequence[Any], i: int, n: int) -> memoryview:
    dest = as_bytes_view(out[i])[0]
    if len(dest) < n:
        raise ValueError(f"output buffer {i} holds {len(dest)} bytes; block is {n}")
    return dest[:n]
