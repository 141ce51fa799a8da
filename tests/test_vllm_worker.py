"""The vLLM connector's worker side without vLLM: a KV cache laid out as vLLM's CPU backend lays it out, a real
in-process store, real clients. Saves, loads, missing blocks, corrupt blocks and request lifetimes."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from kvstore.client import Client
from kvstore.hugepages import HUGE_PAGE, PAGE
from kvstore.integrations.vllm.plan import BlockRun, StepPlan
from kvstore.integrations.vllm.worker import WorkerSide, auto_load_chunk
from tests.test_hugepages import fallbacks, huge_kib, skip_if_the_kernel_ran_short, thp_on

LAYERS, BLOCKS, HEADS, TOKENS, WIDTH = 4, 40, 3, 32, 16


def cache() -> dict[str, torch.Tensor]:
    """One backing buffer, layer after layer, as vLLM allocates it (LBHNC)."""
    per = BLOCKS * HEADS * TOKENS * WIDTH
    buf = torch.zeros(LAYERS * per)
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per : (i + 1) * per].view(BLOCKS, HEADS, TOKENS, WIDTH)
        for i in range(LAYERS)
    }


def keys(n: int, seed: int = 0) -> tuple[bytes, ...]:
    return tuple(bytes([seed, i]) * 8 for i in range(n))


def worker(target: str, lane: str = "auto", **kw) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = cache()
    side = WorkerSide(
        lambda: Client(target, timeout=10, retries=0, lane=lane), dtype="float32", load_chunk=3, save_chunk=2, **kw
    )
    side.register(caches)
    return side, caches


def wait_idle(side: WorkerSide, req: str) -> set[str]:
    deadline = time.monotonic() + 30
    while True:
        done = side.finished_sending({req})
        if done:
            return done
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("lane", ["shm", "tcp"])
def test_register_opens_the_load_streams_lanes_before_any_load(server, lane: str) -> None:
    """The first load used to pay for its client's connection and lane handshake (150-180 ms in ``make run``)."""
    side, _ = worker(f"127.0.0.1:{server.port}", lane, load_streams=2)
    deadline = time.monotonic() + 10
    while server.metrics.counters().get(f"lane_{lane}_open", 0) < 2:  # one lane per load stream
        assert time.monotonic() < deadline, server.metrics.counters()
        time.sleep(0.01)
    side.close()


def test_load_chunk_0_is_chosen_at_register(server) -> None:
    side = WorkerSide(lambda: Client(f"127.0.0.1:{server.port}", timeout=10, retries=0), dtype="float32")
    assert side.load_chunk == 0
    side.register(cache())
    assert side.blocks is not None and side.load_chunk == auto_load_chunk(side.blocks.block_bytes, host=True)
    side.close()


@pytest.mark.parametrize("lane", ["shm", "tcp", "grpc"])
def test_save_then_load_into_other_blocks_of_another_engine(server, lane: str) -> None:
    target = f"127.0.0.1:{server.port}"
    producer, src = worker(target, lane)
    for t in src.values():
        t.normal_()
    run = BlockRun("r1", "ns", keys(7), (3, 4, 5, 6, 7, 8, 9))
    producer.save(StepPlan(saves=[run]))
    assert producer.finished_sending(set()) is None  # not finished yet: vLLM keeps the blocks
    assert wait_idle(producer, "r1") == {"r1"}
    assert producer.finished_sending({"r1"}) is None  # reported once
    c = producer.counters
    assert (c.save_blocks_stored, c.save_failures, c.saves_in_flight) == (7, 0, 0)
    producer.save(StepPlan(saves=[BlockRun("r2", "ns", keys(2), (3, 4))]))
    wait_idle(producer, "r2")
    assert producer.counters.save_blocks_present == 2

    consumer, dst = worker(target, lane, saves=False)
    consumer.load(StepPlan(loads=[BlockRun("q", "ns", keys(7), (20, 21, 22, 23, 24, 25, 26))]))
    assert consumer.take_load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][20:27], src[name][3:10])
        assert not dst[name][:20].any() and not dst[name][27:].any()  # nothing written outside the run
    c = consumer.counters
    assert c.load_blocks == 7 and c.lane == lane and c.copies_per_block_load == {"shm": 1, "tcp": 2, "grpc": 3}[lane]
    assert consumer.finished_sending({"q"}) is None  # a consumer never holds blocks
    producer.close()
    consumer.close()


def test_each_worker_rank_saves_and_loads_its_own_part_of_a_block(server) -> None:
    """Two tensor-parallel ranks hold different bytes for the same blocks: each is stored under its rank's
    hashes, and a rank loads its own part, not another rank's."""
    target = f"127.0.0.1:{server.port}"
    ranks = (keys(4, seed=1), keys(4, seed=2))
    run = BlockRun("r", "ns", ranks[0], (3, 4, 5, 6), b"", ranks, (b"", b""))
    sources = []
    for rank in range(2):
        producer, src = worker(target, rank=rank)
        for t in src.values():
            t.fill_(rank + 1)
        producer.save(StepPlan(saves=[run]))
        wait_idle(producer, "r")
        assert producer.counters.save_blocks_stored == 4  # not refused as already present
        producer.close()
        sources.append(src)
    for rank in (1, 0):
        consumer, dst = worker(target, saves=False, rank=rank)
        consumer.load(StepPlan(loads=[replace(run, block_ids=(20, 21, 22, 23), req_id="q")]))
        assert consumer.take_load_errors() == set()
        for name, src in sources[rank].items():
            assert torch.equal(dst[name][20:24], src[3:7])
        consumer.close()


def test_a_rank_that_does_not_store_still_reports_its_saves_done(server) -> None:
    """MLA's second TP rank holds the bytes rank 0 stores: it Puts nothing, and vLLM still hears the request's
    saves are done (it frees the blocks only once every worker says so)."""
    side, _ = worker(f"127.0.0.1:{server.port}", stores_saves=False)
    side.save(StepPlan(saves=[BlockRun("m", "ns", keys(3, seed=9), (1, 2, 3))]))
    assert side.finished_sending({"m"}) == {"m"}
    assert side.counters.save_blocks_sent == 0
    with Client(f"127.0.0.1:{server.port}") as kv:
        assert kv.lookup("ns", list(keys(3, seed=9))) == 0
    side.close()


def test_a_missing_block_fails_the_rest_of_its_run(server) -> None:
    target = f"127.0.0.1:{server.port}"
    producer, src = worker(target)
    for t in src.values():
        t.normal_()
    producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(6, 1), tuple(range(6)))]))
    wait_idle(producer, "r")
    with Client(target) as c:
        assert c.delete("ns", [keys(6, 1)[4]]) == 1
    consumer, dst = worker(target, saves=False)
    for t in dst.values():
        t.fill_(7.0)
    consumer.load(StepPlan(loads=[BlockRun("q", "ns", keys(6, 1), tuple(range(10, 16)))]))
    assert consumer.take_load_errors() == {14, 15}
    assert consumer.take_load_errors() == set()  # reported once
    for name in src:
        assert torch.equal(dst[name][10:14], src[name][0:4])
        assert not dst[name][14:16].any()  # zeroed: nothing half-written is left for the forward pass
    assert consumer.counters.load_failed_blocks == 2
    producer.close()
    consumer.close()


@pytest.mark.parametrize("lane", ["shm", "tcp", "grpc"])
def test_a_corrupt_block_is_never_loaded(server, lane: str) -> None:
    target = f"127.0.0.1:{server.port}"
    producer, src = worker(target, lane)
    for t in src.values():
        t.normal_()
    producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(5, 2), tuple(range(5)))]))
    wait_idle(producer, "r")
    leases = server.store.acquire("ns", [keys(5, 2)[1]])
    leases[0].buffer[100] ^= 0xFF  # flip a stored byte in the arena
    server.store.release(leases)
    consumer, dst = worker(target, lane, saves=False)
    for t in dst.values():
        t.fill_(7.0)
    consumer.load(StepPlan(loads=[BlockRun("q", "ns", keys(5, 2), (30, 31, 32, 33, 34))]))
    errors = consumer.take_load_errors()
    assert 31 in errors and errors == set(range(min(errors), 35))
    for name in src:  # the Get wrote the corrupt bytes in place: they are zeroed before vLLM sees them
        assert not dst[name][min(errors) : 35].any()
        assert torch.equal(dst[name][30 : min(errors)], src[name][0 : min(errors) - 30])
    producer.close()
    consumer.close()


def test_store_down_fails_the_load_and_the_save_quietly() -> None:
    from kvstore.free_port import free_port

    target = f"127.0.0.1:{free_port()}"
    side, _ = worker(target)
    side.load(StepPlan(loads=[BlockRun("q", "ns", keys(4), (1, 2, 3, 4))]))
    assert side.take_load_errors() == {1, 2, 3, 4}
    side.save(StepPlan(saves=[BlockRun("r", "ns", keys(2), (1, 2))]))
    assert wait_idle(side, "r") == {"r"}  # a failed save still ends: its blocks go back to vLLM
    assert side.counters.save_failures == 1
    side.close()


@pytest.mark.parametrize("preempted", [True, False])
def test_preemption_waits_for_the_saves_reading_its_blocks(server, preempted: bool) -> None:
    side, _ = worker(f"127.0.0.1:{server.port}")
    side.save(StepPlan(saves=[BlockRun("r", "ns", keys(8, 3), tuple(range(8)))]))
    side.preempting(StepPlan(preempted=frozenset({"r"} if preempted else {"other"})))
    if preempted:  # returned only once the save no longer reads the blocks: done at once below
        assert side.finished_sending({"r"}) == {"r"}
    else:
        wait_idle(side, "r")
    side.close()


@pytest.mark.parametrize("dram_index", [False, True])
@pytest.mark.parametrize("verify", [True, False])
def test_loads_from_a_shared_dram_arena(make_server, verify: bool, dram_index: bool) -> None:
    """``serve --share-dram``: the worker copies DRAM hits from the mapped arena into its pages, named by the
    store or (``dram_index``) found by its clients in the store's DRAM index once the store served them the
    namespace. With ``verify_loads`` a corrupt DRAM block is caught by the worker's own CRC32C and never
    loaded; without, the store's checks (at write and on NVMe reads) are all there is, and a corrupt DRAM
    byte goes through."""
    server = make_server(share_dram=True, dram_index=dram_index)
    target = f"127.0.0.1:{server.port}"
    producer, src = worker(target, "shm")
    for t in src.values():
        t.normal_()
    producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(5, 3), tuple(range(5)))]))
    wait_idle(producer, "r")
    consumer, dst = worker(target, "shm", saves=False, verify_loads=verify)
    consumer.load(StepPlan(loads=[BlockRun("q", "ns", keys(5, 3), (20, 21, 22, 23, 24))]))
    assert consumer.take_load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][20:25], src[name][0:5])
    if not dram_index:  # every block named by the store (with the index, which are depends on the streams' order)
        assert server.metrics.counters()["lane_shm_dram_get_bytes"] == 5 * consumer.counters.block_bytes
    leases = server.store.acquire("ns", [keys(5, 3)[1]])
    leases[0].buffer[100] ^= 0xFF  # flip a stored byte in the arena
    server.store.release(leases)
    consumer.load(StepPlan(loads=[BlockRun("q2", "ns", keys(5, 3), (30, 31, 32, 33, 34))]))
    errors = consumer.take_load_errors()
    if verify:
        assert 31 in errors and errors == set(range(min(errors), 35))
        for name in src:
            assert not dst[name][min(errors) : 35].any()
    else:
        assert errors == set()
    producer.close()
    consumer.close()


@pytest.mark.skipif(not thp_on(), reason="transparent huge pages are off on this kernel")
def test_a_host_cache_is_collapsed_into_huge_pages_and_loads_into_them(server) -> None:
    """torch's 4 KiB pages under a CPU cache made the store's process_vm_writev 1.3-1.5x slower (docs/vllm.md)."""
    blocks = 4 * HUGE_PAGE // (HEADS * TOKENS * WIDTH * 4) + 1  # over 4 huge pages a layer, in one allocation
    per = blocks * HEADS * TOKENS * WIDTH
    big = torch.zeros(LAYERS * per)
    big[:: PAGE // 4] = 1.0  # faulted in, as torch.zeros leaves a vLLM cache
    marks = float(big.sum())
    caches = {
        f"model.layers.{i}.self_attn.attn": big[i * per : (i + 1) * per].view(blocks, HEADS, TOKENS, WIDTH)
        for i in range(LAYERS)
    }
    target = f"127.0.0.1:{server.port}"
    producer, src = worker(target, "shm")
    for t in src.values():
        t.normal_()
    producer.save(StepPlan(saves=[BlockRun("r", "ns", keys(5), (0, 1, 2, 3, 4))]))
    wait_idle(producer, "r")
    before = fallbacks()
    side = WorkerSide(lambda: Client(target, timeout=10, retries=0, lane="shm"), dtype="float32", saves=False)
    side.register(caches)
    assert side.huge_pages_settled(60)
    got = huge_kib(big.data_ptr(), big.numel() * 4)
    whole = (big.numel() * 4 // HUGE_PAGE - 1) * HUGE_PAGE // 1024
    skip_if_the_kernel_ran_short(got, whole, before)
    assert got >= whole  # every whole 2 MiB (64-byte aligned)
    assert float(big.sum()) == marks  # the contents survive the collapse
    side.load(StepPlan(loads=[BlockRun("q", "ns", keys(5), (10, 11, 12, 13, 14))]))
    assert side.take_load_errors() == set()
    for name in src:
        assert torch.equal(caches[name][10:15], src[name][:5])
    side.close()
    producer.close()


def test_huge_pages_false_leaves_the_cache_alone() -> None:
    side = WorkerSide(lambda: Client("127.0.0.1:1", timeout=1, retries=0), dtype="float32", huge_pages=False)
    side.register(cache())
    assert "kvstore-huge-pages" not in {t.name for t in threading.enumerate()}
    side.close()
