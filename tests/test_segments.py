"""Segments: a block given as several host buffers (a vLLM block is one slice per layer), on every lane.

Round trips against the concatenation on shm (direct: multi-iovec process_vm_readv/writev; region: chained
copies), tcp (sendmsg / recvmsg_into) and gRPC; corruption of one segment caught by the CRC32C and nothing
stored; Segments beside plain payloads in one call; and the bookkeeping (runs of pieces and IOV_MAX entries,
spans, chunks) against pure models with hypothesis, the syscalls included.
"""

from __future__ import annotations

import os
import socket
import threading

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit
from kvstore.checksum import crc32c
from kvstore.client import Client, KVStoreError, Segments
from kvstore.lanes import cma, framing
from kvstore.lanes.client.outputs import direct_outs
from kvstore.lanes.segments import (
    clip,
    describe_source,
    descriptor_spans,
    flatten,
    page_aligned,
    pieces,
    skip,
    unflatten,
)
from kvstore.memops import address_of
from kvstore.payload import SegmentRows, SegmentsWriter
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.test_lanes_support import RawLanes, header, keys

LANES = {  # name: (Client lane, server options)
    "shm-direct": ("shm", {"shm_direct": True, "share_dram": False}),  # the store writes into the client's memory
    "shm-region": ("shm", {"shm_direct": False, "share_dram": False}),
    "shm-dram": ("shm", {"share_dram": True, "dram_index": False}),  # the store names blocks in its mapped arena
    "shm-index": ("shm", {"share_dram": True}),  # the client finds them in the store's DRAM index itself
    "tcp": ("tcp", {}),
    "grpc": ("grpc", {}),
}
UNEVEN = [1, 0, 4099, 49152, 300_000, 1, 0, 700_001, 7]  # 1-byte and empty parts, parts across pieces


def segments(rng: np.random.Generator, sizes: list[int]) -> Segments:
    """Random bytes in parts of every kind a caller may hand over."""
    parts: list = []
    for i, n in enumerate(sizes):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        kind = i % 4
        if kind == 0:
            parts.append(data)
        elif kind == 1:
            parts.append(bytes(data))
        elif kind == 2:
            parts.append(bytearray(data.tobytes()))
        else:
            parts.append(torch.from_numpy(data.copy()))
    return Segments(parts)


def empty_like(sizes: list[int]) -> Segments:
    return Segments([torch.zeros(n, dtype=torch.uint8) if i % 2 else bytearray(n) for i, n in enumerate(sizes)])


def flat(x) -> bytes:
    return bytes(x.join()) if isinstance(x, Segments) else bytes(x)


@pytest.fixture(params=list(LANES))
def lane_client(request, make_server):
    lane, options = LANES[request.param]
    server = make_server(**options)
    with Client(f"127.0.0.1:{server.port}", lane=lane, timeout=30) as kv:
        yield request.param, kv, server


def test_uneven_segments_round_trip_on_every_lane(lane_client):
    name, kv, server = lane_client
    rng = np.random.default_rng(1)
    blocks = [segments(rng, UNEVEN) for _ in range(4)]
    ks = keys(4)
    assert [r.status for r in kv.put("ns", ks, blocks)] == ["stored"] * 4
    assert kv.lane_kind == LANES[name][0]
    assert [bytes(b) for b in kv.get("ns", ks)] == [flat(b) for b in blocks]
    layout = UNEVEN[::-1] + [5]  # another split of the same bytes, with room to spare at the end
    outs = [empty_like(layout) for _ in ks]
    got = kv.get("ns", ks, out=outs)
    assert all(g is o for g, o in zip(got, outs))
    total = sum(UNEVEN)
    assert [flat(o)[:total] for o in outs] == [flat(b) for b in blocks]
    counters = server.metrics.counters()
    if name == "shm-direct":  # the store read and wrote the segments where they are
        assert counters["lane_shm_direct_put_bytes"] == 4 * total
        assert counters["lane_shm_direct_get_bytes"] == 4 * total
    if name == "shm-region":
        assert "lane_shm_direct_put_bytes" not in counters and counters["lane_shm_put_bytes"] == 4 * total
    if name == "shm-dram":  # the store named the blocks in its arena; the client copied them across the parts
        assert counters["lane_shm_dram_get_bytes"] == 4 * total
    if name == "shm-index":  # the first Get was asked; the second found every block in the index, unasked
        assert "lane_shm_dram_get_bytes" not in counters
        assert kv._lanes.run(lambda lane: lane.indexed.hits) == 4  # noqa: SLF001


def test_more_segments_than_iov_max_in_one_block(lane_client):
    _, kv, _ = lane_client
    rng = np.random.default_rng(2)
    sizes = [int(n) for n in rng.integers(0, 400, 1500)] + [600_000]  # 1,500+ iovecs in one block
    block = segments(rng, sizes)
    assert kv.put("ns", keys(1), [block])[0].status == "stored"
    layout = [int(n) for n in rng.integers(1, 300, 1100)]
    layout.append(block.nbytes - sum(layout))
    out = empty_like(layout)
    kv.get("ns", keys(1), out=[out])
    assert flat(out) == flat(block)


def test_segments_beside_plain_payloads_in_one_call(lane_client):
    _, kv, _ = lane_client
    rng = np.random.default_rng(3)
    seg = segments(rng, [30_000] * 30)
    plain = rng.integers(0, 256, 900_000, dtype=np.uint8)
    payloads = [seg, plain, bytes(seg.join())[::-1], segments(rng, [1, 2, 3])]
    ks = keys(4, seed=9)
    assert all(r.status == "stored" for r in kv.put("ns", ks, payloads))
    outs = [empty_like([450_000, 450_000]), bytearray(900_000), np.zeros(900_000, np.uint8), bytearray(6)]
    got = kv.get("ns", ks, out=outs)
    assert [flat(g) for g in got] == [flat(p) if isinstance(p, Segments) else bytes(p) for p in payloads]


def test_a_short_segments_destination_is_refused(lane_client):
    _, kv, _ = lane_client
    block = os.urandom(100_000)
    kv.put("ns", keys(1), [block])
    with pytest.raises((KVStoreError, ValueError)):
        kv.get("ns", keys(1), out=[empty_like([50_000, 49_999])])


def test_a_corrupted_stored_block_fails_the_check_of_a_scattered_get(lane_client):
    _, kv, server = lane_client
    block = segments(np.random.default_rng(4), [49152] * 30)
    kv.put("ns", keys(1), [block])
    (lease,) = server.store.acquire("ns", keys(1))
    try:
        np.frombuffer(lease.buffer, dtype=np.uint8)[5 * 49152 + 17] ^= 0xFF  # in the sixth layer's bytes
    finally:
        server.store.release([lease])
    with pytest.raises(KVStoreError) as err:
        kv.get("ns", keys(1), out=[empty_like([49152] * 30)])
    assert err.value.code == grpc.StatusCode.DATA_LOSS


# -- a segment corrupted on its way in: the store's CRC32C check refuses the block ----------------------
def test_tcp_put_with_a_segment_corrupted_in_transit_stores_nothing_for_it(make_server):
    server = make_server()
    raw = RawLanes(server)
    lane = raw.tcp()
    rng = np.random.default_rng(5)
    blocks = [segments(rng, [49152] * 30) for _ in range(2)]
    target = blocks[1].views[7]  # a small part is sent as the very view object

    class Flipping:
        def __init__(self, sock):
            self._sock = sock

        def sendmsg(self, bufs):
            bufs = [memoryview(bytes([b[0] ^ 1]) + bytes(b[1:])) if b is target else b for b in bufs]
            return self._sock.sendmsg(bufs)

        def __getattr__(self, name):
            return getattr(self._sock, name)

    lane.sock = Flipping(lane.sock)
    headers = [header(k, flat(b)) for k, b in zip(keys(2), blocks)]
    results = lane.put("ns", headers, blocks)  # the corrupted block alone is refused, in its result
    assert [r.status for r in results] == ["stored", "rejected"]
    assert results[1].code == grpc.StatusCode.INVALID_ARGUMENT and "CRC" in results[1].reason
    lane.close()
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        got = kv.get("ns", keys(2), allow_missing=True)
        assert got[1] is None and bytes(got[0]) == flat(blocks[0])
    raw.close()


def test_grpc_put_with_a_segment_corrupted_in_transit_stores_nothing_for_it(make_server):
    server = make_server()
    blocks = [segments(np.random.default_rng(6), [49152] * 30) for _ in range(2)]
    with Client(f"127.0.0.1:{server.port}", lane="grpc", retries=0) as kv:
        put = kv._put_raw  # the raw Put's call: its requests are encoded PutRequests (kvstore/block_messages.py)

        def corrupting(requests, **kw):
            def flipped():
                for raw in requests:
                    msg = pb.PutRequest.FromString(raw)
                    if msg.HasField("header") and msg.header.hash == keys(2)[1]:
                        msg.data = bytes([msg.data[0] ^ 1]) + msg.data[1:]
                    yield msg.SerializeToString()

            return put(flipped(), **kw)

        kv._put_raw = corrupting
        results = kv.put("ns", keys(2), blocks)  # the corrupted block alone is refused, in its result
        assert [r.status for r in results] == ["stored", "rejected"]
        assert results[1].code == grpc.StatusCode.INVALID_ARGUMENT
        kv._put_raw = put
        assert kv.get("ns", keys(2), allow_missing=True)[1] is None


def test_region_put_of_segments_checks_the_bytes_that_landed(make_server):
    """Each segment is copied into the region with its CRC32C fused in, chained: the commit vouches for the
    block's CRC, and the store checks it on what reached its arena."""
    server = make_server(shm_direct=False)
    raw = RawLanes(server)
    lane = raw.shm()
    assert not lane.direct
    rng = np.random.default_rng(7)
    good, bad = segments(rng, UNEVEN), segments(rng, [49152] * 30)
    stream = lane.open_put()
    grant = stream.reserve("ns", [header(k, flat(b)) for k, b in zip(keys(2), [good, bad])])
    crcs = [lane.write(slot, b) for slot, b in zip(grant.slots, [good, bad])]
    assert crcs == [crc32c(flat(good)), crc32c(flat(bad))]
    lane.region.view[grant.slots[1].offset + 3 * 49152 + 5] ^= 1  # one segment's bytes changed after the copy
    descriptors = [
        lpb.BlockDescriptor(index=j, hash=k, offset=s.offset, length=s.length, crc32c=c)
        for j, (k, s, c) in enumerate(zip(keys(2), grant.slots, crcs))
    ]
    stream.send_commit(grant.grant_id, descriptors)
    results = stream.committed()  # the changed block alone is refused, in its result; the commit goes on
    assert [r.status for r in results] == [pb.PUT_STORED, pb.PUT_REJECTED]
    assert results[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    stream.close()
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        got = kv.get("ns", keys(2), allow_missing=True)  # the block before the bad one stays, as documented
        assert flat(got[0]) == flat(good) and got[1] is None
    lane.close()
    raw.close()


def test_direct_commit_of_segments_checks_the_bytes_it_read(make_server):
    """A commit naming a block's segments in client memory, with the CRC32C the client vouches for: the store
    reads them (one pass, many iovecs) and refuses the block when a segment changed."""
    server = make_server()
    raw = RawLanes(server)
    lane = raw.shm()
    assert lane.direct
    rng = np.random.default_rng(8)
    blocks = [segments(rng, [49152] * 30), segments(rng, [49152] * 30)]
    crcs = [b.crc32c() for b in blocks]
    stream = lane.open_put()
    grant = stream.reserve("ns", [header(k, flat(b)) for k, b in zip(keys(2), blocks)])
    first = describe_source(
        lpb.BlockDescriptor(index=0, hash=keys(2)[0], offset=grant.slots[0].offset, length=grant.slots[0].length),
        blocks[0].spans,
    )
    first.crc32c = crcs[0]
    stream.send_commit(grant.grant_id, [first])
    assert stream.committed()[0].status == pb.PUT_STORED
    blocks[1].parts[12][100] ^= 1  # a numpy part, changed after its CRC was taken
    second = describe_source(
        lpb.BlockDescriptor(index=1, hash=keys(2)[1], offset=grant.slots[1].offset, length=grant.slots[1].length),
        blocks[1].spans,
    )
    second.crc32c = crcs[1]
    stream.send_commit(grant.grant_id, [second])
    (result,) = stream.committed()  # refused in its result, as on the gRPC Put
    assert result.status == pb.PUT_REJECTED and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    stream.close()
    lane.close()
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        got = kv.get("ns", keys(2), allow_missing=True)
        assert flat(got[0]) == flat(blocks[0]) and got[1] is None
    raw.close()


def test_direct_reserve_whose_segments_do_not_add_up_is_refused(make_server):
    server = make_server()
    raw = RawLanes(server)
    lane = raw.shm()
    data = bytearray(os.urandom(1000))
    address = cma.address_of(memoryview(data))[0]
    stream = lane.open_put()
    with pytest.raises(KVStoreError) as err:
        stream.reserve("ns", [header(keys(1)[0], bytes(data))], segments=([2], [address, address + 500], [500, 499]))
        stream.committed()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    stream.close()
    lane.close()
    raw.close()


def test_coded_transfers_join_the_segments(make_server):
    server = make_server()
    block = Segments([np.arange(n, dtype=np.float32) for n in (1000, 0, 12_288, 5)])
    with Client(f"127.0.0.1:{server.port}", lane="grpc", codec="zstd") as kv:
        assert kv.put("ns", keys(1), [block])[0].status == "stored"
        out = Segments([np.zeros(n, dtype=np.float32) for n in (5, 13_288)])
        kv.get("ns", keys(1), out=[out])
        assert flat(out) == flat(block)


# -- the bookkeeping against pure models ----------------------------------------------------------------
lengths_st = st.lists(st.integers(0, 300), max_size=40)


@given(lengths=lengths_st, piece=st.integers(1, 500), iov_max=st.integers(1, 8))
def test_pieces_cover_every_byte_once_in_order_within_both_limits(lengths, piece, iov_max):
    runs = list(pieces(lengths, piece, iov_max))
    model = [(i, j) for i, n in enumerate(lengths) for j in range(n)]  # (buffer, offset) of each byte
    assert [(i, off + k) for run in runs for i, off, n in run for k in range(n)] == model
    for r, run in enumerate(runs):
        size = sum(n for _, _, n in run)
        assert run and all(n > 0 for _, _, n in run) and size <= piece and len(run) <= iov_max
        if r < len(runs) - 1:
            assert size == piece or len(run) == iov_max  # a run ends only at a limit


@given(spans=st.lists(st.tuples(st.integers(1, 1 << 40), st.integers(0, 99)), max_size=20), n=st.integers(0, 3000))
def test_clip_keeps_the_first_bytes(spans, n):
    clipped = clip(tuple(spans), n)
    model = [(a + k) for a, length in spans for k in range(length)][:n]
    assert [(a + k) for a, length in clipped for k in range(length)] == model


@given(spans=st.lists(st.tuples(st.integers(1, 1 << 40), st.integers(0, 99)), max_size=20), n=st.integers(0, 3000))
def test_skip_keeps_every_byte_but_the_first(spans, n):
    rest = skip(tuple(spans), n)
    model = [(a + k) for a, length in spans for k in range(length)][n:]
    assert [(a + k) for a, length in rest for k in range(length)] == model
    assert all(length > 0 for _, length in rest)


@given(
    spans=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 3)), max_size=8),
    shift=st.sampled_from([0, 512]),
    pages=st.integers(0, 12),
)
def test_page_aligned_says_whether_the_first_pages_lie_in_whole_aligned_pages(spans, shift, pages):
    """Spans of whole pages, one of them shifted by half a page or not: aligned exactly when each span the first
    ``pages`` pages touch starts on a page and the part of it they take is whole pages."""
    table = tuple((page * 4096 + (shift if i == 1 else 0), n * 4096) for i, (page, n) in enumerate(spans))
    n = min(pages, sum(n for _, n in spans)) * 4096
    taken, left = [], n
    for address, length in table:
        if left <= 0:
            break
        taken.append((address, min(length, left)))
        left -= length
    assert page_aligned(table, n) == all(a % 4096 == 0 and t % 4096 == 0 for a, t in taken)


@given(blocks=st.lists(st.lists(st.tuples(st.integers(1, 1 << 40), st.integers(1, 1 << 20)), max_size=6), max_size=8))
def test_flatten_round_trips(blocks):
    spans = [tuple(b) for b in blocks]
    table = unflatten("t", len(spans), *flatten(spans))
    assert list(table) == spans and table[:] == spans
    assert table.held.tolist() == [sum(n for _, n in s) for s in spans]
    assert table.counts().tolist() == [len(s) for s in spans]
    for k, s in enumerate(spans):
        assert table[k - len(spans)] == s and table.rows(k).tolist() == [list(x) for x in s]
    with pytest.raises(IndexError):
        table[len(spans)]
    for s in spans:
        d = describe_source(lpb.BlockDescriptor(length=sum(n for _, n in s)), s)
        assert descriptor_spans(d) == (s if s else ())


@given(kinds=st.lists(st.sampled_from(["array", "readonly", "bytearray", "segments"]), max_size=8))
def test_direct_outs_spans_every_kind_of_buffer_as_the_general_way_does(kinds):
    """``direct_outs``'s one-step path for writable arrays builds the table the general way builds; any other
    buffer (segments, a bytearray, a read-only array: the store's write will say what is wrong with it) sends the
    whole list the general way, which spans it the same."""
    backing = np.zeros(1 << 16, dtype=np.uint8)
    out: list[object] = []
    for k, kind in enumerate(kinds):
        part = backing[k * 4096 : (k + 1) * 4096]
        if kind == "readonly":
            part = part.copy()
            part.flags.writeable = False
        made = {"array": part, "readonly": part, "bytearray": bytearray(100 + k)}.get(kind)
        out.append(made if made is not None else Segments([part[:1000], part[2000:3000]]))
    table = direct_outs(out)
    assert table is not None
    want = [host_spans(buf) for buf in out]
    assert list(table) == want and table.held.tolist() == [sum(n for _, n in s) for s in want]
    assert table.starts.dtype == np.int64 and table.table.dtype == np.uint64 and table.held.dtype == np.int64


def host_spans(buf: object) -> tuple[tuple[int, int], ...]:
    if isinstance(buf, Segments):
        return tuple((int(p.ctypes.data), p.nbytes) for p in buf.parts)
    if isinstance(buf, bytearray):
        return (address_of(memoryview(buf)),)
    assert isinstance(buf, np.ndarray)
    return ((int(buf.ctypes.data), buf.nbytes),)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), piece=st.integers(1, 700), iov_max=st.integers(1, 5))
def test_cross_memory_reads_and_writes_of_spans_match_the_model(monkeypatch, data, piece, iov_max):
    """process_vm_readv/writev on this process's own memory, with pieces and IOV_MAX made small."""
    if not cma.available():
        pytest.skip("Linux only")
    monkeypatch.setattr(cma, "PIECE", piece)
    monkeypatch.setattr(cma, "IOV_MAX", iov_max)
    lengths = data.draw(st.lists(st.integers(0, 500), min_size=1, max_size=12))
    source = Segments([bytearray(os.urandom(n)) for n in lengths])
    total = bytes(source.join())
    dst = bytearray(len(total))
    assert cma.read_spans_into(os.getpid(), memoryview(dst), source.spans) == crc32c(total)
    assert bytes(dst) == total
    target = Segments([bytearray(n) for n in lengths])
    assert cma.write_spans_from(os.getpid(), target.spans, memoryview(total)) == crc32c(total)
    assert bytes(target.join()) == total


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch=st.integers(1, 9))
def test_scattered_writes_of_many_blocks_match_the_model(monkeypatch, data, batch):
    """``cma.write_scattered`` on this process's own memory: blocks across several buffers (empty ones too), cut
    into syscalls of at most ``IOV_BATCH`` spans (made small), a block of more spans than that written alone."""
    if not cma.available():
        pytest.skip("Linux only")
    monkeypatch.setattr(cma, "IOV_BATCH", batch)
    blocks = data.draw(st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=12), min_size=1, max_size=8))
    sources = [os.urandom(sum(lengths)) for lengths in blocks]
    targets = [Segments([bytearray(n) for n in lengths]) for lengths in blocks]
    cma.write_scattered(os.getpid(), [(t.spans, memoryview(bytearray(src))) for t, src in zip(targets, sources)])
    assert [bytes(t.join()) for t in targets] == sources


def test_a_scattered_write_to_memory_that_is_not_there_names_the_blocks():
    if not cma.available():
        pytest.skip("Linux only")
    good = Segments([bytearray(8), bytearray(8)])
    with pytest.raises(cma.DirectReadError, match="wrote 8 of 16 bytes of 1 blocks in 2 spans"):
        cma.write_scattered(os.getpid(), [(((good.spans[0]), (8, 8)), memoryview(bytearray(16)))])
    with pytest.raises(ValueError, match="2 spans of 16 bytes for 12 local bytes"):
        cma.write_scattered(os.getpid(), [(good.spans, memoryview(bytearray(12)))])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), piece=st.integers(1, 900), iov_max=st.integers(1, 6), tables=st.booleans())
def test_socket_gather_and_scatter_match_the_model(monkeypatch, data, piece, iov_max, tables):
    """``tables``: the receiver also gives each block's span table, so a block of one run takes the compiled
    check of its pages (the kernels compiled first) instead of a CRC32C call a page."""
    if tables and memops_jit.AVAILABLE:
        memops_jit.warm_up()
    monkeypatch.setattr(framing, "IOV_MAX", iov_max)
    blocks = data.draw(st.lists(st.lists(st.integers(0, 400), max_size=10), min_size=1, max_size=4))
    sources = [Segments([os.urandom(n) for n in b]) for b in blocks]
    layouts = [data.draw(st.permutations(b)) for b in blocks]  # the same sizes, split another way
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(
            target=framing.send_blocks_crc, args=(a, [memoryview(b"head")], [s.views for s in sources], piece)
        )
        sender.start()
        head = bytearray(4)
        framing.recv_into(b, memoryview(head))
        for source, layout in zip(sources, layouts):
            target = Segments([bytearray(n) for n in layout])
            spans = target.span_table if tables else None
            crc = framing.recv_views_crc(b, target.head_views(source.nbytes), piece=piece, spans=spans)
            trailer = bytearray(4)
            framing.recv_into(b, memoryview(trailer))
            assert bytes(target.join()) == bytes(source.join())
            assert crc == framing.CRC.unpack(trailer)[0] == crc32c(bytes(source.join()))
        sender.join()
    finally:
        a.close()
        b.close()


@given(lengths=st.lists(st.integers(0, 200), max_size=12), size=st.integers(1, 300), cut=st.integers(0, 2000))
def test_chunks_writer_and_head_views_match_the_concatenation(lengths, size, cut):
    seg = Segments([os.urandom(n) for n in lengths])
    whole = bytes(seg.join())
    chunks = list(seg.chunks(size))
    assert b"".join(chunks) == whole and all(0 < len(c) <= size for c in chunks)
    assert b"".join(bytes(v) for v in seg.head_views(cut)) == whole[:cut]
    target = Segments([bytearray(n) for n in reversed(lengths)])
    writer = SegmentsWriter(target, len(whole))
    at = 0
    for c in chunks:
        writer[at : at + len(c)] = c
        at += len(c)
    assert bytes(target.join()) == whole and writer.crc32c() == crc32c(whole) == seg.crc32c()
    back = Segments([bytearray(n) for n in lengths])
    back.scatter(whole)
    assert bytes(back.join()) == whole


def test_segments_report_dtype_and_refuse_non_contiguous_parts():
    assert Segments([torch.zeros(3, dtype=torch.float16), torch.ones(2, dtype=torch.float16)]).dtype == "float16"
    assert Segments([torch.zeros(3, dtype=torch.float16), b"xy"]).dtype == "uint8"
    with pytest.raises(ValueError):
        _ = Segments([torch.zeros(4, 4).t()]).spans
    with pytest.raises(ValueError):
        _ = Segments([np.zeros((4, 4))[:, 1]]).views


def test_segment_rows_build_the_same_blocks_as_slices(make_server):
    layers = [torch.rand(8, 3, 4, 16) for _ in range(5)]
    rows = SegmentRows(layers)
    for b in (0, 3, 7):
        block, generic = rows.block(b), Segments([layer[b] for layer in layers])
        assert bytes(block.join()) == bytes(generic.join())
        assert block.spans == generic.spans and block.lengths == generic.lengths and block.dtype == "float32"
        assert np.array_equal(block.span_table, generic.span_table)  # made from row 0's, without the tuples
    with pytest.raises(IndexError):
        rows.block(8)
    with pytest.raises(ValueError):
        SegmentRows([torch.zeros(8, 4), torch.zeros(7, 4)])
    server = make_server()
    out = [torch.zeros(8, 3, 4, 16) for _ in range(5)]
    with Client(f"127.0.0.1:{server.port}", lane="shm") as kv:
        assert all(r.status == "stored" for r in kv.put("ns", keys(8), [rows.block(b) for b in range(8)]))
        back = SegmentRows(out)
        kv.get("ns", keys(8), out=[back.block(b) for b in range(8)])
    assert all(torch.equal(a, b) for a, b in zip(layers, out))
    assert server.metrics.counters()["lane_shm_direct_put_bytes"] == 8 * 5 * 3 * 4 * 16 * 4


def test_a_server_without_segmented_reserves_gets_them_through_the_region(make_server):
    """A store that predates Segments reads one address per block: the client puts Segments through the
    region there (its OpenLaneResponse has no direct_segments) instead of waiting on a commit that never comes."""
    server = make_server()
    raw = RawLanes(server)
    lane = raw.shm()
    assert lane.direct and lane.direct_segments
    lane.direct_segments = False  # as an older server answers
    block = segments(np.random.default_rng(10), UNEVEN)
    results = lane.put("ns", [header(keys(1)[0], flat(block))], [block])
    assert results[0].status == "stored"
    assert "lane_shm_direct_put_bytes" not in server.metrics.counters()
    with Client(f"127.0.0.1:{server.port}", lane="grpc") as kv:
        assert flat(kv.get("ns", keys(1))[0]) == flat(block)
    lane.close()
    raw.close()
