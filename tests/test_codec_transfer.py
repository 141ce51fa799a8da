"""Coded transfers through a real server: byte-exact lossless round trips, the lossy policy, codec stats."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from kvstore.checksum import crc32c
from kvstore.client import Client, KVStoreError
from kvstore.codecs import codec_id, decode, encode
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BLOCK_ELEMS = 48 * 1024  # 96 KiB of bf16: three blocks make one 256 KiB batch
LOSSLESS = ["none", "zstd", "byteplane", "lz4", "auto"]


def kv_blocks(n: int, seed: int = 0) -> list[torch.Tensor]:
    """bf16 blocks shaped like KV (per-channel scales, a few large channels), distinct per seed."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(64, generator=gen))
    return [(torch.randn(BLOCK_ELEMS // 64, 64, generator=gen) * scale).to(torch.bfloat16) for _ in range(n)]


def raw(block: torch.Tensor) -> bytes:
    return block.contiguous().view(torch.uint8).numpy().tobytes()


def keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


@pytest.fixture
def node(make_server):
    return make_server(lossy_namespaces="lossy-*")


def target(node) -> str:
    return f"127.0.0.1:{node.port}"


@pytest.mark.parametrize("codec", LOSSLESS)
def test_lossless_round_trip_byte_exact(node, codec):
    blocks, hashes = kv_blocks(10), keys(10)
    with Client(target(node), lane="grpc", codec=codec) as kv:
        assert all(r.status == "stored" for r in kv.put("ns", hashes, blocks))
        coded = kv.get("ns", hashes)  # the server may code them again for a reader that accepts codecs
        outs = [np.empty(BLOCK_ELEMS * 2, dtype=np.uint8) for _ in hashes]
        kv.get("ns", hashes, out=outs)
    with Client(target(node), lane="grpc") as plain:  # codec none: raw bytes, whatever was stored
        fetched = plain.get("ns", hashes)
    for i, block in enumerate(blocks):
        assert bytes(coded[i]) == raw(block)
        assert outs[i].tobytes() == raw(block)
        assert bytes(fetched[i]) == raw(block)


def test_coded_blocks_are_stored_coded_and_decoded_into_tensors(node):
    blocks, hashes = kv_blocks(6, seed=1), keys(6)
    with Client(target(node), lane="grpc", codec="byteplane") as kv:
        kv.put("ns", hashes, blocks)
        out = [torch.empty(BLOCK_ELEMS, dtype=torch.bfloat16) for _ in hashes]
        kv.get("ns", hashes, out=out)
    assert all(torch.equal(o, b.reshape(-1)) for o, b in zip(out, blocks))
    stored = [node.store.acquire("ns", [h])[0] for h in hashes]
    try:
        assert {lease.codec for lease in stored} == {pb.CODEC_BYTEPLANE}
        assert all(lease.stored_length < lease.raw_length for lease in stored)
    finally:
        for lease in stored:
            node.store.release([lease])


def test_coded_put_on_a_tcp_lane_client_travels_on_grpc(node):
    blocks, hashes = kv_blocks(4, seed=2), keys(4)
    with Client(target(node), lane="tcp", codec="zstd") as kv:
        kv.put("ns", hashes, blocks)
        assert [bytes(b) for b in kv.get("ns", hashes, codec="none")] == [raw(b) for b in blocks]  # raw: tcp lane
        assert kv.lane_kind == "tcp"


def test_lossy_codec_refused_where_the_namespace_forbids_it(node):
    blocks, hashes = kv_blocks(3), keys(3)
    with Client(target(node), lane="grpc", codec="fp8") as kv:
        with pytest.raises(KVStoreError) as err:
            kv.put("plain", hashes, blocks, lossy_ok=True)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "lossless" in err.value.message
        assert kv.lookup("plain", hashes) == 0
        with pytest.raises(ValueError, match="lossy"):
            kv.put("lossy-ns", hashes, blocks)  # a lossy codec needs the caller's lossy_ok


def test_lossy_codec_stored_where_allowed_and_verified(node):
    blocks, hashes = kv_blocks(3, seed=3), keys(3)
    with Client(target(node), lane="grpc", codec="fp8+zstd") as kv:
        assert all(r.status == "stored" for r in kv.put("lossy-ns", hashes, blocks, lossy_ok=True))
        got = kv.get("lossy-ns", hashes, lossy_ok=True)  # CRC32C of the decoded bytes is checked
    for g, b in zip(got, blocks):
        expected = decode("fp8+zstd", encode("fp8+zstd", raw(b), "bfloat16"), "bfloat16", len(raw(b)))
        assert bytes(g) == expected


def test_auto_never_picks_lossy_where_the_server_forbids_it(node):
    blocks, hashes = kv_blocks(24, seed=4), keys(24)
    with Client(target(node), lane="grpc", codec="auto") as kv:
        assert not kv.lossy_allowed("plain") and kv.lossy_allowed("lossy-ns")
        assert all(r.ok for r in kv.put("plain", hashes, blocks, lossy_ok=True))
        choices = {k: v for k, v in kv.codec_stats().items() if k.startswith("codec.choices.")}
        assert choices["codec.choices.fp8"] == choices["codec.choices.fp8+zstd"] == 0
        assert sum(choices.values()) == 8  # one choice per 256 KiB batch of three blocks
        assert [bytes(b) for b in kv.get("plain", hashes, lossy_ok=True)] == [raw(b) for b in blocks]
        assert "codec.fp8.bfloat16.256KiB-1MiB.ratio" not in kv.codec_stats()  # not even calibrated
        kv.put("lossy-ns", keys(24), kv_blocks(24, seed=5), lossy_ok=True)  # allowed: lossy arms are calibrated
        assert kv.codec_stats()["codec.fp8.bfloat16.256KiB-1MiB.ratio"] > 1.5
    counters = node.metrics.counters()
    assert counters.get("codec_get_choices_fp8", 0) == 0 and counters.get("codec_get_choices_fp8_zstd", 0) == 0


def test_server_get_controller_codes_raw_blocks_and_shows_in_stats(node):
    blocks, hashes = kv_blocks(12, seed=6), keys(12)
    with Client(target(node), lane="grpc") as writer:
        writer.put("lossy-ns", hashes, blocks)  # stored raw
    with Client(target(node), lane="grpc", codec="auto") as reader:
        first = reader.get("lossy-ns", hashes)
        second = reader.get("lossy-ns", hashes)  # carries the decode report of the first
        counters = reader.stats()["counters"]
    assert [bytes(b) for b in first] == [raw(b) for b in blocks] == [bytes(b) for b in second]
    chosen = {k: v for k, v in counters.items() if k.startswith("codec_get_choices_")}
    assert sum(chosen.values()) == 8 and chosen["codec_get_choices_fp8"] == 0  # the reader did not accept lossy
    assert counters["codec_get_bandwidth_bps"] > 0 and "codec_get_bandwidth_samples" in counters
    assert sum(v for k, v in counters.items() if k.startswith("codec_get_blocks_")) == 24
    assert any(k.endswith("_decode_gbps") for k in counters)
    scrape = generate_latest(node.metrics.registry).decode()
    assert "kvstore_codec_get_bandwidth_bps" in scrape and "kvstore_codec_get_choices_byteplane" in scrape


def test_reader_reports_decode_time_with_its_next_get(node, monkeypatch):
    blocks, hashes = kv_blocks(6, seed=7), keys(6)
    reports: list[list[pb.CodecTiming]] = []
    original = node.service.coding.observe_report
    monkeypatch.setattr(node.service.coding, "observe_report", lambda m: (reports.append(list(m)), original(m)))
    with Client(target(node), lane="grpc", codec="zstd") as kv:
        kv.put("ns", hashes, blocks)
        kv.get("ns", hashes)
        kv.get("ns", hashes[:1])
    assert reports[0] == []
    timing = reports[1][0]
    assert timing.codec == pb.CODEC_ZSTD and timing.blocks == 6 and timing.raw_bytes == 6 * BLOCK_ELEMS * 2
    assert timing.seconds > 0 and timing.dtype == "bfloat16"


def test_put_reply_reports_what_verifying_cost(node):
    data = raw(kv_blocks(1, seed=8)[0])
    enc = encode("zstd", data, "bfloat16")
    header = pb.BlockHeader(
        hash=os.urandom(16),
        codec=codec_id("zstd"),
        raw_length=len(data),
        stored_length=len(enc),
        crc32c=crc32c(data),
        dtype="bfloat16",
    )
    with grpc.insecure_channel(target(node)) as channel:
        reply = pb_grpc.KVStoreStub(channel).Put(iter([pb.PutRequest(namespace="ns", header=header, data=enc)]))
    assert reply.results[0].status == pb.PUT_STORED
    (timing,) = reply.decode_timings
    assert timing.codec == pb.CODEC_ZSTD and timing.raw_bytes == len(data) and timing.seconds > 0
    assert node.metrics.counters()["codec_put_blocks_zstd"] == 1


def test_namespace_stats_tell_the_lossy_policy(node):
    with Client(target(node), lane="grpc") as kv:
        assert kv.stats("lossy-a")["counters"]["codec_lossy_allowed"] == 1.0
        assert kv.stats("other")["counters"]["codec_lossy_allowed"] == 0.0


def test_a_coded_put_to_a_store_with_a_small_max_message_goes_in_chunks_within_it(make_server):
    """A store whose --max-message (256 KiB) is under the 1 MiB chunk refuses the first coded Put's message, and
    the client sends it again in chunks within half the limit the refusal names, as it does raw Puts."""
    server = make_server(max_message=256 << 10)
    gen = torch.Generator().manual_seed(7)
    blocks = [torch.randn(256 << 10, generator=gen).to(torch.bfloat16) for _ in range(3)]  # 512 KiB each
    hashes = keys(3)
    with Client(target(server), lane="grpc", codec="zstd") as kv:
        assert all(r.status == "stored" for r in kv.put("ns", hashes, blocks))
        assert [bytes(b) for b in kv.get("ns", hashes)] == [raw(b) for b in blocks]
