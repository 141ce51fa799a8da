"""The pieces of coded transfers: the wire clock, the prepare pipeline, decode reports, policy, counters."""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import pytest

from kvstore.checksum import crc32c
from kvstore.codecs import decode, encode, sendclock
from kvstore.codecs.controller import Controller, ControllerConfig
from kvstore.codecs.policy import LossyPolicy, is_lossy
from kvstore.codecs.sendclock import SendClock
from kvstore.codecs.transfer import DecodeTally, TransferPlan, metric_items, prepare, transfer_config
from kvstore.codecs.transfer_server import ServerCoding
from kvstore.codecs.warmup import calibrate
from kvstore.server import validate
from kvstore.server.metrics import Metrics
from kvstore.v1 import kvstore_pb2 as pb

BLOCK = 96 * 1024


def kv_like(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n, BLOCK // 2)) * 0.1).astype(np.float32)
    return [(row.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) for row in values]  # bf16 bytes


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(sendclock, "time", fake)
    monkeypatch.setattr(sendclock, "host_cpu", lambda: None)
    samples: list[tuple[int, float]] = []
    return fake, samples, SendClock(lambda n, s: samples.append((n, s)), window_bytes=1 << 30)


# -- SendClock ------------------------------------------------------------------------------------
def test_clock_without_stalls_is_bytes_over_wall_time(clock):
    fake, samples, c = clock
    c.begin()
    for _ in range(4):
        fake.now += 0.25
        c.sent(1000)
    c.finish(drained=False)
    assert samples == [(4000, pytest.approx(1.0))]


def test_clock_stalls_give_the_geometric_mean_of_both_bounds(clock):
    fake, samples, c = clock
    c.begin()
    fake.now += 0.5
    c.stalled(0.5)  # the sender waited half a second for the encoder
    fake.now += 0.5
    c.sent(1000)
    fake.now += 0.1
    c.finish(drained=True)  # a short drain: the link kept up with the sender
    assert samples == [(1000, pytest.approx(math.sqrt(1.1 * 0.6)))]


def test_clock_long_drain_means_link_bound(clock):
    fake, samples, c = clock
    c.begin()
    fake.now += 0.2
    c.stalled(0.1)
    c.sent(1000)
    fake.now += 0.8  # the reply came long after the last bytes were handed over
    c.finish(drained=True)
    assert samples == [(1000, pytest.approx(1.0))]


def test_clock_windows(clock):
    fake, samples, _ = clock
    c = SendClock(lambda n, s: samples.append((n, s)), window_bytes=2000)
    c.begin()
    for _ in range(5):
        fake.now += 1.0
        c.sent(1000)
    c.finish()
    assert samples == [(2000, pytest.approx(2.0)), (2000, pytest.approx(2.0)), (1000, pytest.approx(1.0))]


def test_saturated_host_only_raises_the_estimate(clock, monkeypatch):
    fake, samples, _ = clock
    ticks = iter([(0, 100), (95, 200), (95, 200), (190, 300)])  # 95% busy in both windows
    monkeypatch.setattr(sendclock, "host_cpu", lambda: next(ticks))
    c = SendClock(lambda n, s: samples.append((n, s)), estimate=lambda: 1500.0, window_bytes=1 << 30)
    c.begin()
    fake.now += 1.0
    c.sent(1000)  # 1000 B/s < estimate: a CPU-bound transport says nothing about the link
    c.finish()
    c.begin()
    fake.now += 1.0
    c.sent(2000)  # 2000 B/s: the link is at least that fast
    c.finish()
    assert samples == [(2000, pytest.approx(1.0))]


# -- prepare ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["zstd", "byteplane", "fp8", "fp8+zstd"])
def test_prepare_checksums_raw_bytes_or_what_the_receiver_decodes(codec):
    blocks = kv_like(7, seed=1)
    batches = list(prepare(blocks, TransferPlan("bfloat16", codec)))
    assert [b.encoded.start for b in batches] == [0, 3, 6]  # >= 256 KiB per batch, in order
    for batch in batches:
        for j, payload in enumerate(batch.encoded.payloads):
            block = blocks[batch.encoded.start + j]
            decoded = decode(codec, payload, "bfloat16", block.nbytes)
            assert batch.crcs[j] == crc32c(decoded)
            if codec in ("zstd", "byteplane"):
                assert decoded == block.tobytes()
        assert batch.prepare_s > 0


def test_prepare_uses_known_crcs_and_feeds_the_controller():
    blocks = kv_like(6, seed=2)
    ctl = Controller(transfer_config())
    batches = list(prepare(blocks, TransferPlan("bfloat16", "auto", ctl), crcs=[7] * 6))
    assert all(c == 7 for b in batches for c in b.crcs if not b.encoded.codec.startswith("fp8"))
    snap = ctl.snapshot()
    assert sum(v for k, v in snap.items() if k.startswith("codec.choices.")) == 2
    # calibration observed every lossless arm on the first batch, before any choice
    assert snap["codec.byteplane.bfloat16.256KiB-1MiB.observations"] >= 1


def test_raw_runs_skip_the_worker_and_coded_batches_use_it(monkeypatch):
    from dataclasses import replace

    from kvstore.codecs import transfer

    blocks = kv_like(12, seed=5)  # 4 batches of 3 blocks
    ctl = Controller(replace(transfer_config(), epsilon=0.0))  # 10 Gbit/s until told otherwise
    plan = TransferPlan("bfloat16", "auto", ctl)
    list(prepare(blocks, plan))  # the first transfer calibrates, on a worker
    # then coding costs 20 ns a byte on each end whatever this host measured (a fast zstd once beat raw bytes on
    # a CI host): raw bytes win at 10 Gbit/s (1.25 ns a byte), the best ratio at 100 Mbit/s (80 ns a byte)
    for arm in ctl.arms:
        if arm != "none":
            wire = sum(len(encode(arm, b, "bfloat16")) for b in blocks[:3])
            for _ in range(30):
                ctl.observe(arm, plan.context(3 * BLOCK), 3 * BLOCK, wire, 3 * BLOCK * 20e-9, 3 * BLOCK * 20e-9)
    spawned: list = []
    run = transfer._WORKERS.run
    monkeypatch.setattr(transfer._WORKERS, "run", lambda fn: (spawned.append(fn), run(fn)))
    known = [None, 5] + [None] * 10
    batches = list(prepare(blocks, TransferPlan("bfloat16", "auto", ctl), crcs=known))
    assert not spawned and [b.encoded.codec for b in batches] == ["none"] * 4
    assert [c for b in batches for c in b.crcs] == [5 if k else crc32c(blk) for blk, k in zip(blocks, known)]
    assert [b.encoded.start for b in batches] == [0, 3, 6, 9]
    assert ctl.snapshot()["codec.choices.none"] == 8  # one choice per batch still counted
    assert list(prepare(blocks, TransferPlan("bfloat16", "none"))) and not spawned  # a raw plan: no worker
    for _ in range(3):  # a slow link: coding wins, on the worker
        ctl.observe_transfer(8 << 20, (8 << 20) / 12.5e6)
    batches = list(prepare(blocks, TransferPlan("bfloat16", "auto", ctl)))
    assert len(spawned) == 1 and {b.encoded.codec for b in batches} == {"byteplane"}
    for batch in batches:
        for j, payload in enumerate(batch.encoded.payloads):
            assert decode("byteplane", payload, "bfloat16", BLOCK) == blocks[batch.encoded.start + j].tobytes()


def test_prepare_raises_encoder_errors_in_the_consumer_and_stops_early():
    blocks = kv_like(9, seed=3)
    calls = {"n": 0}

    def choose(_batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("encoder broke")
        return "zstd"

    plan = TransferPlan("bfloat16", "zstd")
    plan.choose = choose  # type: ignore[method-assign]
    stream = prepare(blocks, plan)
    next(stream)
    with pytest.raises(RuntimeError, match="encoder broke"):
        next(stream)
    early = prepare(blocks, TransferPlan("bfloat16", "none"))
    next(early)
    early.close()  # the worker stops and the thread goes back to the pool
    assert threading.active_count() < 20


def test_calibration_runs_once_per_controller_and_arm():
    ctl = Controller(ControllerConfig(arms=("none", "zstd")))
    blocks = kv_like(3, seed=4)
    ctx = TransferPlan("bfloat16", "auto", ctl).context(3 * BLOCK)
    calibrate(ctl, ["none", "zstd"], "bfloat16", blocks, ctx)
    calibrate(ctl, ["none", "zstd"], "bfloat16", blocks, ctx)
    snap = ctl.snapshot()
    assert snap["codec.zstd.bfloat16.256KiB-1MiB.observations"] == 1  # one timed round (a warm one before it)
    # calibrated arms are not tried on the wire first: the first choice is the model's
    assert ctl.snapshot()["codec.explorations"] == 0
    ctl.choose(ctx)
    assert ctl.snapshot()["codec.explorations"] == 0
    assert 1.0 < snap["codec.zstd.bfloat16.256KiB-1MiB.ratio"] < 2.0
    assert snap["codec.zstd.bfloat16.256KiB-1MiB.decode_gbps"] > 0


# -- decode reports, policy, counters ------------------------------------------------------------------
def test_decode_tally_round_trips_the_wire():
    tally = DecodeTally()
    tally.add("zstd", "bfloat16", 1000, 0.5)
    tally.add(1, "bfloat16", 3000, 0.25, blocks=2)
    tally.add("fp8", "float16", 10, 0.1)
    wire = DecodeTally.to_wire(tally.take())
    assert tally.take() == []
    back = {(t.codec, t.dtype): t for t in DecodeTally.from_wire([*wire, pb.CodecTiming(codec=99, raw_bytes=5)])}
    assert back[("zstd", "bfloat16")].raw_bytes == 4000 and back[("zstd", "bfloat16")].blocks == 3
    assert back[("zstd", "bfloat16")].seconds == pytest.approx(0.75) and len(back) == 2


def test_lossy_policy_patterns():
    policy = LossyPolicy.from_spec(" draft-*, scratch ,")
    assert policy.allows("draft-7") and policy.allows("scratch") and not policy.allows("prod")
    assert not LossyPolicy.from_spec("").allows("anything")
    assert is_lossy(pb.CODEC_FP8) and is_lossy("fp8+zstd") and not is_lossy("zstd") and not is_lossy(99)


def test_validation_refuses_lossy_headers_outside_lossy_namespaces():
    header = pb.BlockHeader(hash=bytes(16), codec=pb.CODEC_FP8, raw_length=100, stored_length=60, dtype="bfloat16")
    limits = validate.Limits(lossy=LossyPolicy.from_spec("lossy-*"))
    assert validate.header("lossy-a", header, 0, limits).codec == pb.CODEC_FP8
    with pytest.raises(validate.InvalidRequest, match="lossless KV only"):
        validate.header("prod", header, 0, limits)


def test_metric_names_fit_prometheus():
    names = metric_items(
        "codec_get_",
        {"codec.fp8+zstd.bfloat16.256KiB-1MiB.ratio": 2.0, "codec.choices.none": 3.0, "codec.bandwidth_bps": 1e9},
    )
    assert set(names) == {
        "codec_get_fp8_zstd_bfloat16_256KiB_1MiB_ratio",
        "codec_get_choices_none",
        "codec_get_bandwidth_bps",
    }
    assert all(re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", n) for n in names)


def test_server_get_coding_respects_the_reader_and_the_namespace():
    coding = ServerCoding(Metrics(), LossyPolicy.from_spec("lossy-*"))
    assert coding.begin_get("ns", []) is None and coding.begin_get("ns", [pb.CODEC_NONE]) is None
    accepted = [pb.CODEC_ZSTD, pb.CODEC_FP8, 42]
    assert coding.begin_get("prod", accepted).accepted == {"none", "zstd"}
    lossy = coding.begin_get("lossy-1", accepted)
    assert lossy.accepted == {"none", "zstd", "fp8"} and lossy.lossy_ok
    fixed = ServerCoding(Metrics(), codec="byteplane")
    assert fixed.begin_get("ns", accepted).plan("bfloat16").codec == "none"  # the reader cannot decode byteplane
    assert fixed.begin_get("ns", [pb.CODEC_BYTEPLANE]).plan("bfloat16").codec == "byteplane"


def test_encode_payload_sizes_shrink_on_kv_like_data():
    block = kv_like(1, seed=5)[0]
    assert len(encode("byteplane", block, "bfloat16")) < 0.9 * block.nbytes
