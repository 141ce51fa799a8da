"""The Put reply contract (DESIGN 2.3, docs/wire.md "Put"): every block that arrived whole gets a result, a bad
CRC rejects that block alone, and an aborted stream says exactly how many blocks before the fault were handled."""

from __future__ import annotations

import grpc
import pytest

from kvstore.checksum import crc32c
from kvstore.server.service import PUT_HANDLED_KEY
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

KEYS = [bytes([i]) * 16 for i in range(1, 5)]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


def block(key: bytes, data: bytes, *, first: bool = False, crc_flip: int = 0, chunk: int = 0) -> list[pb.PutRequest]:
    hdr = pb.BlockHeader(
        hash=key, raw_length=len(data), stored_length=len(data), crc32c=crc32c(data) ^ crc_flip, dtype="uint8"
    )
    step = chunk or len(data)
    msgs = [pb.PutRequest(namespace="ns" if first else "", header=hdr, data=data[:step])]
    return msgs + [pb.PutRequest(data=data[i : i + step]) for i in range(step, len(data), step)]


def test_bad_crc_rejects_that_block_alone_and_the_stream_goes_on(stub, server):
    datas = [bytes([i]) * (3000 + i) for i in range(4)]
    stream = [
        *block(KEYS[0], datas[0], first=True),
        *block(KEYS[1], datas[1], crc_flip=1, chunk=1000),  # several chunks, the CRC is checked at the end
        *block(KEYS[2], datas[2]),
        *block(KEYS[0], datas[0]),  # a repeat of a stored block in the same stream
    ]
    reply = stub.Put(iter(stream), timeout=10)
    statuses = [(r.hash, r.status, r.code) for r in reply.results]
    assert statuses == [
        (KEYS[0], pb.PUT_STORED, 0),
        (KEYS[1], pb.PUT_REJECTED, INVALID),
        (KEYS[2], pb.PUT_STORED, 0),
        (KEYS[0], pb.PUT_ALREADY_PRESENT, 0),
    ]
    assert "block 1" in reply.results[1].reason and "CRC32C mismatch" in reply.results[1].reason
    assert [server.store.lookup("ns", [k])[0] for k in KEYS[:3]] == [1, 0, 1]
    assert server.store.stats()["blocks"] == 2
    got = list(stub.Get(pb.GetRequest(namespace="ns", hashes=[KEYS[2]]), timeout=10))
    assert b"".join(m.data for m in got) == datas[2]


def test_a_resent_block_after_its_crc_rejection_is_stored(stub, server):
    data = b"r" * 4096
    first = stub.Put(iter(block(KEYS[0], data, first=True, crc_flip=4)), timeout=10).results[0]
    assert first.status == pb.PUT_REJECTED
    assert stub.Put(iter(block(KEYS[0], data, first=True)), timeout=10).results[0].status == pb.PUT_STORED


def abort(stub, stream) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter(stream), timeout=10)
    return err.value


def handled(err: grpc.RpcError) -> int:
    return int(dict(err.trailing_metadata() or ())[PUT_HANDLED_KEY])


def test_an_aborted_stream_names_what_was_handled(stub, server):
    good, bad = b"g" * 100, b"b" * 100
    stream = [
        *block(KEYS[0], good, first=True),
        *block(KEYS[1], bad, crc_flip=1),  # rejected, still handled
        *block(KEYS[2], good),
        *block(KEYS[3], good)[:1],  # then a header cut short by the next one: the stream cannot be read on
        pb.PutRequest(header=pb.BlockHeader(hash=KEYS[3], raw_length=1, stored_length=1, dtype="uint8")),
    ]
    stream[-2].data = good[:10]
    err = abort(stub, stream)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block 3: header of the next block arrived after 10 of 100 bytes" in err.details()
    assert "blocks 0..2 of this stream were handled" in err.details()
    assert "nothing from block 3 on was stored" in err.details()
    assert handled(err) == 3
    assert [server.store.lookup("ns", [k])[0] for k in KEYS] == [1, 0, 1, 0]


@pytest.mark.parametrize(
    "fault",
    [
        [pb.PutRequest(namespace="ns", data=b"abc")],  # data before any header
        [pb.PutRequest(namespace="ns", header=pb.BlockHeader(hash=b"short", raw_length=1, stored_length=1))],
    ],
)
def test_a_stream_aborted_at_its_first_block_stored_nothing(stub, server, fault):
    err = abort(stub, fault)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "no block of this stream was stored" in err.details()
    assert handled(err) == 0
    assert server.store.stats()["blocks"] == 0


def test_blocks_before_an_abort_are_written_through(make_server, tmp_path):
    """Under write-through the blocks handled before the fault reach NVMe before the abort, as on success."""
    server = make_server(nvme_dir=str(tmp_path), nvme=64 << 20, nvme_segment=8 << 20, write_policy="write-through")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        err = abort(pb_grpc.KVStoreStub(channel), [*block(KEYS[0], b"d" * 4096, first=True), pb.PutRequest(data=b"x")])
    assert handled(err) == 1
    nvme = [t for t in server.store.stats()["tiers"] if t["name"] == "nvme"]
    assert nvme and nvme[0]["blocks"] == 1
