"""The connector's staged path: a device KV cache (CUDA where one exists) filled through ``load_streams + 1``
staging buffers, in pinned host memory or on the device, one copy call per run of consecutive blocks. Without a
GPU the same path runs on a host cache with ``staging="host"`` (host buffers), so CI keeps it; ``bench.gpu_check``
runs the CUDA cases."""

from __future__ import annotations

import pytest
import torch

from kvstore.client import Client
from kvstore.integrations.vllm.cache_blocks import consecutive_runs
from kvstore.integrations.vllm.plan import BlockRun, StepPlan
from kvstore.integrations.vllm.worker import WorkerSide
from tests.test_devices import DEVICES, HAS_CUDA
from tests.test_vllm_worker import BLOCKS, HEADS, LAYERS, TOKENS, WIDTH, keys, wait_idle

# (device, staging): on a host cache both stagings are the same host buffers, so CI runs one of them
PLACES = [
    ("cpu", "host"),
    *[pytest.param(d.values[0], staging, marks=d.marks) for d in DEVICES[1:] for staging in ("host", "device")],
]


def cache(device: str) -> dict[str, torch.Tensor]:
    per = BLOCKS * HEADS * TOKENS * WIDTH
    buf = torch.zeros(LAYERS * per, device=device)
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per : (i + 1) * per].view(BLOCKS, HEADS, TOKENS, WIDTH)
        for i in range(LAYERS)
    }


def staged_worker(
    target: str, device: str, staging: str, lane: str = "shm", **kw
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = cache(device)
    side = WorkerSide(
        lambda: Client(target, timeout=10, retries=0, lane=lane),
        dtype="float32",
        load_chunk=3,
        save_chunk=2,
        staging=staging,
        **kw,
    )
    side.register(caches)
    assert side.staged and side.staging_place == ("device" if staging == "device" and device != "cpu" else "host")
    return side, caches


def settled(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The caches once every copy queued on the stream has landed (loads from the host only queue them)."""
    if any(t.is_cuda for t in caches.values()):
        torch.cuda.synchronize()
    return caches


def test_consecutive_runs() -> None:
    assert consecutive_runs([]) == []
    assert consecutive_runs([4, 5, 6, 9, 2, 3, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2), (6, 3, 1)]


@pytest.mark.parametrize(("device", "staging"), PLACES)
@pytest.mark.parametrize("lane", ["shm", "tcp", "grpc"])
def test_staged_save_then_load_lands_every_block_and_nothing_else(server, device: str, staging: str, lane: str):
    target = f"127.0.0.1:{server.port}"
    producer, src = staged_worker(target, device, staging, lane)
    for t in src.values():
        t.normal_()
    saved = (3, 4, 5, 9, 10, 2, 7, 8, 11)  # runs of consecutive ids and single ones, across chunks of 2
    producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(9, 4), saved)]))
    assert wait_idle(producer, "r") == {"r"}
    assert producer.counters.save_blocks_stored == 9

    consumer, dst = staged_worker(target, device, staging, lane, saves=False)
    targets = [(20, 21, 22, 30, 31, 5, 6, 7, 0), (33, 34, 35, 36, 37, 38, 39, 1, 2)]
    for req, ids in enumerate(targets):  # two loads in a row reuse both staging buffers
        consumer.load(StepPlan(loads=[BlockRun(f"q{req}", "ns", keys(9, 4), ids)]))
        assert consumer.take_load_errors() == set()
    settled(dst)
    written = torch.zeros(BLOCKS, dtype=torch.bool)
    for ids in targets:
        for name in src:
            for b_src, b_dst in zip(saved, ids):
                assert torch.equal(dst[name][b_dst], src[name][b_src]), (name, b_src, b_dst)
        written[list(ids)] = True
    for name in dst:
        assert not dst[name][~written.to(dst[name].device)].any()  # nothing written outside the runs
    c = consumer.counters
    assert c.load_blocks == 18 and c.copies_per_block_load >= 2
    producer.close()
    consumer.close()


@pytest.mark.parametrize(("device", "staging"), PLACES)
def test_staged_load_of_a_corrupt_or_missing_block_zeroes_it_and_the_rest(server, device: str, staging: str):
    target = f"127.0.0.1:{server.port}"
    producer, src = staged_worker(target, device, staging)
    for t in src.values():
        t.normal_()
    hashes = keys(8, 5)
    producer.save(StepPlan(saves=[BlockRun("r", "ns", hashes, tuple(range(8)))]))
    wait_idle(producer, "r")
    leases = server.store.acquire("ns", [hashes[4]])
    leases[0].buffer[100] ^= 0xFF  # flip a stored byte in the arena: block 4 fails its CRC32C
    server.store.release(leases)
    with Client(target) as kv:
        assert kv.delete("ns", [hashes[6]]) == 1

    consumer, dst = staged_worker(target, device, staging, saves=False)
    for t in dst.values():
        t.fill_(7.0)
    consumer.load(StepPlan(loads=[BlockRun("q", "ns", hashes, tuple(range(20, 28)))]))
    errors = consumer.take_load_errors()
    assert 24 in errors and errors == set(range(min(errors), 28))  # the corrupt block and every one after it
    settled(dst)
    for name in src:
        assert torch.equal(dst[name][20 : min(errors)], src[name][0 : min(errors) - 20])
        assert not dst[name][min(errors) : 28].any()  # nothing half-written is left for the forward pass
    consumer.load(StepPlan(loads=[BlockRun("q2", "ns", hashes[:4], (30, 31, 32, 33))]))
    assert consumer.take_load_errors() == set()  # the staging buffers are fine after a failed load
    for name in src:
        assert torch.equal(settled(dst)[name][30:34], src[name][0:4])
    producer.close()
    consumer.close()


def test_staging_must_be_named() -> None:
    with pytest.raises(ValueError, match="staging"):
        WorkerSide(lambda: None, dtype="float32", staging="gpu")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py there)")
@pytest.mark.parametrize("staging", ["host", "device"])
def test_cuda_cache_against_a_store_process(staging: str) -> None:
    """A real ``kvstore serve`` on the GPU host: with ``lane="auto"`` device staging moves blocks device to device
    over the cuda_ipc lane; host staging goes over the shm lane into pinned memory."""
    from kvstore.server.process import store_process

    with store_process("--dram", "512MiB") as (target, _):
        producer, src = staged_worker(target, "cuda", staging, "auto")
        for t in src.values():
            t.normal_()
        producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(10, 6), tuple(range(10)))]))
        wait_idle(producer, "r")
        assert producer.counters.save_blocks_stored == 10
        consumer, dst = staged_worker(target, "cuda", staging, "auto", saves=False)
        consumer.load(StepPlan(loads=[BlockRun("q", "ns", keys(10, 6), tuple(range(20, 30)))]))
        assert consumer.take_load_errors() == set()
        settled(dst)
        for name in src:
            assert torch.equal(dst[name][20:30], src[name][0:10])
        print(f"staging={staging}: lane {consumer.counters.lane}")
        producer.close()
        consumer.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("streams", [1, 4])
def test_staged_loads_with_several_gets_in_flight(server, device: str, streams: int) -> None:
    """``load_streams`` Gets at once into ``load_streams + 1`` buffers, each reused within a load and across
    loads: every block lands where its run says."""
    target = f"127.0.0.1:{server.port}"
    producer, src = staged_worker(target, device, "host")
    for t in src.values():
        t.normal_()
    producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(17, 7), tuple(range(17)))]))
    wait_idle(producer, "r")
    consumer, dst = staged_worker(target, device, "host", saves=False, load_streams=streams)
    assert len(consumer._load_staging) == streams + 1
    for shift in (20, 21):  # the second load overwrites the first, shifted by one block
        consumer.load(StepPlan(loads=[BlockRun(f"q{shift}", "ns", keys(17, 7), tuple(range(shift, shift + 17)))]))
        assert consumer.take_load_errors() == set()
    for name in src:
        assert torch.equal(settled(dst)[name][21:38], src[name][0:17])
    producer.close()
    consumer.close()
