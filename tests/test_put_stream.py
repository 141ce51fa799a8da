"""The gRPC Put stream's two forms: a block as its header and chunks, and whole small blocks packed several to a
message (``PutRequest.blocks``) once the server's PutResponse set ``packed_bytes``.

``put_requests`` against protobuf's reader (hypothesis: block sizes around the chunk, both forms, every message
within the server's ``packed_bytes``), then a real store: Puts after the first go packed and every block comes
back exact; a packed message whose bytes do not match its blocks, or that arrives mid-block, is INVALID_ARGUMENT
naming what was handled; a packed block that fails its CRC32C is rejected alone; a server that does not say
``packed_bytes`` (an older one) never gets the packed form, and one with a small ``--max-message`` gets packed
messages within it. What a refusal teaches (``PutShape``): a first Put over a small ``--max-message`` goes again in
chunks within the limit the refusal names; an older store replaced under a packing client gets that Put again
unpacked; a refusal of the Put's content is raised.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block_messages import encode_put
from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.put_stream import HEADER_OVERHEAD, PutShape, put_call, put_requests
from kvstore.v1 import kvstore_pb2 as pb

CHUNK = 4096


def header_of(data: bytes, i: int = 0) -> pb.BlockHeader:
    return pb.BlockHeader(
        hash=i.to_bytes(16, "little"),
        stored_length=len(data),
        raw_length=len(data),
        crc32c=crc32c(data),
        dtype="uint8",
    )


def reassemble(messages: list[bytes]) -> tuple[str, list[bytes], list[pb.PutRequest]]:
    """Namespace and each block's bytes, as a server reads the stream (through protobuf's own parser)."""
    parsed = [pb.PutRequest.FromString(m) for m in messages]
    blocks: list[bytes] = []
    current: bytearray | None = None
    for msg in parsed:
        assert not (msg.blocks and msg.HasField("header"))  # one form or the other
        if msg.blocks:
            assert current is None and len(msg.data) == sum(h.stored_length for h in msg.blocks) <= CHUNK
            at = 0
            for h in msg.blocks:
                blocks.append(msg.data[at : at + h.stored_length])
                at += h.stored_length
            continue
        if msg.HasField("header"):
            assert current is None
            current = bytearray()
            want = msg.header.stored_length
        assert current is not None and len(msg.data) <= CHUNK
        current += msg.data
        if len(current) == want:
            blocks.append(bytes(current))
            current = None
    assert current is None
    return parsed[0].namespace, blocks, parsed


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * CHUNK), min_size=1, max_size=20),
    packed=st.sampled_from([0, CHUNK // 2, CHUNK]),
)
def test_put_requests_carry_every_block_in_order_in_either_form(sizes, packed):
    rng = np.random.default_rng(len(sizes))
    blocks = [rng.bytes(n) for n in sizes]
    headers = [header_of(b, i) for i, b in enumerate(blocks)]
    messages = list(put_requests("ns", headers, [memoryview(b) for b in blocks], CHUNK, packed))
    namespace, got, parsed = reassemble(messages)
    assert namespace == "ns" and all(m.namespace == "" for m in parsed[1:])
    assert got == blocks
    assert all(len(raw) <= packed + 8 for raw, m in zip(messages, parsed) if m.blocks)  # the namespace's few bytes
    fits = any(len(b) + h.ByteSize() + HEADER_OVERHEAD <= packed for b, h in zip(blocks, headers))
    assert any(m.blocks for m in parsed) == fits
    per_block = sum(max(1, -(-n // CHUNK)) for n in sizes)
    assert len(messages) <= per_block


def test_sixteen_small_blocks_are_one_message():
    blocks = [bytes([i]) * 256 for i in range(16)]
    messages = list(put_requests("ns", [header_of(b, i) for i, b in enumerate(blocks)], blocks, 16 << 10, 16 << 10))
    assert len(messages) == 1 and len(pb.PutRequest.FromString(messages[0]).blocks) == 16


# -- through a store --------------------------------------------------------------------------------------------
def test_puts_after_the_first_go_packed_and_come_back_exact(make_server):
    server = make_server()
    rng = np.random.default_rng(3)
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        sent: list[list[bytes]] = []
        call = kv._put_raw  # noqa: SLF001 - the raw Put's call, to see the messages it sends

        def recording(requests, **kw):
            messages = list(requests)
            sent.append(messages)
            return call(iter(messages), **kw)

        kv._put_raw = recording
        for _ in range(2):
            hashes = [rng.bytes(16) for _ in range(40)]
            blocks = [rng.integers(0, 256, n, dtype=np.uint8) for n in [16 << 10] * 36 + [3 << 20] + [1 << 20] * 3]
            assert all(r.ok for r in kv.put("ns", hashes, blocks, chained=False))
            got = kv.get("ns", hashes)
            assert all(bytes(memoryview(g)) == b.tobytes() for g, b in zip(got, blocks))
        first, second = ([pb.PutRequest.FromString(m) for m in ms] for ms in sent)
        assert not any(m.blocks for m in first)  # the client learns packed_bytes from the first reply
        # the 16 KiB blocks went packed; a 1 MiB block with its header is more than a packed message may hold
        assert sum(len(m.blocks) for m in second) == 36
        assert len(second) < len(first)


def _raw_put(server, messages: list[bytes]):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        return put_call(channel).with_call(iter(messages), timeout=10)


@pytest.mark.parametrize("change", [-1, 1])
def test_a_packed_message_whose_bytes_do_not_match_its_blocks_is_invalid_argument(make_server, change):
    server = make_server()
    a, b = b"a" * 100, b"b" * 200
    good = encode_put("ns", header_of(a, 1), [a])
    data = (a + b)[:-1] if change < 0 else a + b + b"x"
    bad = encode_put("", None, [data], [header_of(a, 2), header_of(b, 3)])
    with pytest.raises(grpc.RpcError) as err:
        _raw_put(server, [good, bad])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "packed message" in err.value.details() and "blocks 0..0" in err.value.details()
    assert server.store.lookup("ns", [(1).to_bytes(16, "little")])[0] == 1  # the block before it was stored
    assert server.store.lookup("ns", [(2).to_bytes(16, "little")])[0] == 0


def test_a_packed_message_in_the_middle_of_a_block_is_invalid_argument(make_server):
    server = make_server()
    big, small = b"x" * 8192, b"y" * 10
    first = encode_put("ns", header_of(big, 1), [big[:4096]])
    packed = encode_put("", None, [small], [header_of(small, 2)])
    with pytest.raises(grpc.RpcError) as err:
        _raw_put(server, [first, packed])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mid-block" in err.value.details()
    assert server.store.lookup("ns", [(1).to_bytes(16, "little"), (2).to_bytes(16, "little")])[0] == 0


def test_a_packed_block_that_fails_its_crc_is_rejected_alone(make_server):
    server = make_server()
    blocks = [bytes([i]) * 300 for i in range(4)]
    headers = [header_of(b, i) for i, b in enumerate(blocks)]
    headers[2].crc32c ^= 1
    reply, _ = _raw_put(server, [encode_put("ns", None, blocks, headers)])
    assert [r.status for r in reply.results] == [pb.PUT_STORED, pb.PUT_STORED, pb.PUT_REJECTED, pb.PUT_STORED]
    assert reply.results[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and reply.packed_bytes == 1 << 20
    got = server.store.lookup("ns", [h.hash for h in headers])
    assert got[0] == 2  # blocks 0 and 1 present, 2 missing


def test_a_server_that_does_not_take_packed_puts_never_gets_them(make_server):
    server = make_server()
    rng = np.random.default_rng(5)
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        call = kv._put_raw  # noqa: SLF001 - an older server's reply: no packed_bytes
        sent: list[pb.PutRequest] = []

        def older(requests, **kw):
            messages = list(requests)
            sent.extend(pb.PutRequest.FromString(m) for m in messages)
            reply = call(iter(messages), **kw)
            reply.packed_bytes = 0
            return reply

        kv._put_raw = older
        for _ in range(3):
            hashes = [rng.bytes(16) for _ in range(8)]
            assert all(r.ok for r in kv.put("ns", hashes, [rng.bytes(1024) for _ in hashes], chained=False))
        assert sent and not any(m.blocks for m in sent)


def test_a_store_with_a_small_max_message_gets_packed_messages_within_it(make_server):
    server = make_server(max_message=256 << 10)
    rng = np.random.default_rng(9)
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        for round_ in range(2):  # the second Put packs, in messages of at most half of 256 KiB, and chunks within it
            hashes = [rng.bytes(16) for _ in range(64)]
            # a 512 KiB block only once the client knows the store's limit: the first Put's 1 MiB chunk would pass it
            blocks = [rng.bytes(16 << 10) for _ in hashes[:-1]] + [rng.bytes((512 if round_ else 16) << 10)]
            assert all(r.ok for r in kv.put("ns", hashes, blocks, chained=False))
            assert [bytes(memoryview(g)) for g in kv.get("ns", hashes)] == blocks
        assert kv._put_shape.packed == 128 << 10  # noqa: SLF001 - what the store said it takes


def test_a_first_put_over_a_small_max_message_is_cut_to_the_limit_the_refusal_names(make_server):
    """Before any reply the client sends 1 MiB chunks; a store with --max-message 256 KiB refuses the first message
    over it (RESOURCE_EXHAUSTED, gRPC core naming the limit), and the Put goes again in chunks within half of it."""
    server = make_server(max_message=256 << 10)
    rng = np.random.default_rng(11)
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        hashes = [rng.bytes(16) for _ in range(3)]
        blocks = [rng.bytes(16 << 10), rng.bytes(512 << 10), rng.bytes(1 << 20)]
        assert all(r.ok for r in kv.put("ns", hashes, blocks, chained=False))
        assert [bytes(memoryview(g)) for g in kv.get("ns", hashes)] == blocks
        assert kv._put_shape.limit == 256 << 10  # noqa: SLF001 - what the refusal named


def test_a_store_replaced_by_an_older_one_under_a_live_client_gets_its_puts_unpacked(make_server, monkeypatch):
    """The client packs once a store said it takes packed Puts; the store is then replaced by one that reads
    ``PutRequest.blocks`` as an unknown field (an older release): the packed message reaches it as a data chunk
    with no header (INVALID_ARGUMENT), and the client sends that Put again unpacked, and its next Puts too."""
    server = make_server()
    rng = np.random.default_rng(13)
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        first = [rng.bytes(16) for _ in range(8)]
        assert all(r.ok for r in kv.put("ns", first, [rng.bytes(1024) for _ in first], chained=False))
        assert kv._put_shape.packed > 0  # noqa: SLF001 - the next Put goes packed

        older = type(server.service)
        monkeypatch.setattr(older, "_message_parts", lambda self, msg, state, index: [(msg.header, msg.data)])
        sent: list[pb.PutRequest] = []
        call = kv._put_raw  # noqa: SLF001 - to see the messages sent

        def seen(requests, **kw):
            messages = list(requests)
            sent.extend(pb.PutRequest.FromString(m) for m in messages)
            reply = call(iter(messages), **kw)
            reply.packed_bytes = 0  # as the older store says: nothing
            return reply

        kv._put_raw = seen
        for round_ in range(2):
            hashes = [rng.bytes(16) for _ in range(8)]
            blocks = [rng.bytes(1024) for _ in hashes]
            assert all(r.ok for r in kv.put("ns", hashes, blocks, chained=False))
            assert [bytes(memoryview(g)) for g in kv.get("ns", hashes)] == blocks
            if round_ == 0:  # one packed try, refused, then the same Put unpacked
                assert any(m.blocks for m in sent) and not any(m.blocks for m in sent[1:])
                sent.clear()
        assert sent and not any(m.blocks for m in sent)  # the second Put never packed
        assert kv._put_shape.packed == 0  # noqa: SLF001


def test_a_put_refused_for_its_content_is_raised_not_resent_for_ever(make_server):
    """A refusal the shape does not explain (a header that fails validation) is raised: a packing client sends it
    once more unpacked, and the same refusal then reaches the caller."""
    server = make_server()
    rng = np.random.default_rng(17)
    with Client(f"127.0.0.1:{server.port}", lane="grpc", timeout=30) as kv:
        first = [rng.bytes(16) for _ in range(4)]
        assert all(r.ok for r in kv.put("ns", first, [rng.bytes(1024) for _ in first], chained=False))
        assert kv._put_shape.packed > 0  # noqa: SLF001
        with pytest.raises(KVStoreError) as err:
            kv.put("ns", [b"short"], [rng.bytes(1024)], chained=False)  # a 5-byte hash
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@given(
    refusals=st.lists(
        st.tuples(
            st.sampled_from([grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED]),
            st.integers(0, 8 << 20),
        ),
        max_size=40,
    ),
    packed=st.integers(0, 1 << 20),
)
def test_refusals_change_a_put_shape_a_bounded_number_of_times(refusals, packed):
    """Each refusal that leads to sending again leaves a strictly smaller shape (packing off, or a smaller chunk),
    and any other leaves it as it was, so a store that keeps refusing is answered by raising, never by sending for
    ever; chunks stay positive."""
    shape = PutShape(packed=packed)
    for code, limit in refusals:
        sent_packed, sent_chunk = shape.packed, shape.chunk(1 << 20)
        err = KVStoreError(code, f"SERVER: Received message larger than max ({limit + 1} vs. {limit})")
        if shape.refused(err, sent_packed, sent_chunk):
            assert shape.packed < sent_packed or shape.chunk(1 << 20) < sent_chunk
        else:
            assert (shape.packed, shape.chunk(1 << 20)) == (sent_packed, sent_chunk)
        assert shape.chunk(1 << 20) > 0
