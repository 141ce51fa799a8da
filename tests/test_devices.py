"""Tier and client paths parametrized over device: `cpu` runs everywhere, `cuda` where a GPU exists."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.client import Client  # noqa: E402
from kvstore.config import ServeConfig  # noqa: E402
from kvstore.server.app import StoreServer, build_store  # noqa: E402
from kvstore.store import BlockStore  # noqa: E402
from kvstore.tiers.arena import ArenaTier  # noqa: E402
from kvstore.tiers.base import DRAM, HBM, BlockMeta  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py on a GPU host)"
            ),
        ],
    ),
]


def tier_for(device: str, capacity: int) -> ArenaTier:
    return ArenaTier(capacity, device=device, page_size=1 << 20)


@pytest.mark.parametrize("device", DEVICES)
def test_arena_round_trip(device):
    tier = tier_for(device, 8 << 20)
    assert tier.rank == (HBM if device == "cuda" else DRAM)
    data = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
    meta = BlockMeta("ns", b"k" * 16, b"", 0, "uint8", data.numel(), data.numel(), 0)
    [loc] = tier.write([meta], [data.to(device)])
    out = torch.empty_like(data)
    tier.read([loc], [data.numel()], [out.numpy()])
    assert torch.equal(out, data)
    tier.free([loc])
    assert tier.used_bytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_top_tier_demotes_to_the_next(device):
    """The same arena class at two levels: the upper one demotes leaves to the lower one."""
    upper, lower = tier_for(device, 2 << 20), ArenaTier(8 << 20, page_size=1 << 20)
    if device == "cpu":  # two host arenas stand in for HBM above DRAM
        upper.rank, upper.name = HBM, "hbm"
    store = BlockStore([upper, lower], high_watermark=0.5, low_watermark=0.25)
    payloads = [os.urandom(256 << 10) for _ in range(12)]
    prev = b""
    for i, p in enumerate(payloads):
        key = bytes([i]) * 16
        ticket = store.begin_put("ns", BlockMeta("ns", key, prev, 0, "uint8", len(p), len(p), 0))
        view = ticket.buffer
        if hasattr(view, "copy_"):
            view.copy_(torch.frombuffer(bytearray(p), dtype=torch.uint8))
        else:
            view[:] = p
        store.commit_put(ticket)
        prev = key
    store.demote_once()
    n, ranks = store.lookup("ns", [bytes([i]) * 16 for i in range(12)])
    assert n == 12 and DRAM in ranks and HBM in ranks
    leases = store.acquire("ns", [bytes([i]) * 16 for i in range(12)])
    store.materialize(leases)
    for lease, p in zip(leases, payloads):
        got = lease.buffer.cpu().numpy().tobytes() if hasattr(lease.buffer, "cpu") else bytes(lease.buffer)
        assert got == p
    store.release(leases)
    store.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_client_takes_and_fills_device_tensors(device):
    cfg = ServeConfig(listen="127.0.0.1:0", metrics_port=0, dram=64 << 20)
    tiers = [tier_for(device, 32 << 20), ArenaTier(64 << 20)] if device == "cuda" else None
    server = StoreServer(cfg, store=build_store(cfg, tiers) if tiers else None).start()
    try:
        kv_block = torch.randn(30, 2, 16, 3, 64, device=device).to(torch.bfloat16)
        with Client(f"127.0.0.1:{server.port}") as kv:
            assert kv.put("ns", [b"d" * 16], [kv_block])[0].status == "stored"
            out = torch.empty_like(kv_block)
            kv.get("ns", [b"d" * 16], out=[out])
        assert out.device == kv_block.device and torch.equal(out, kv_block)
    finally:
        server.stop(0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_get_fills_many_device_tensors_beside_host_buffers_call_after_call(device):
    """Without a cuda_ipc lane, CUDA destinations are filled through one pinned buffer per call, kept for the
    next (``devices.stage_out``): tensors of several sizes, host buffers between them, and a second Get into
    other tensors that reuses the buffer."""
    cfg = ServeConfig(listen="127.0.0.1:0", metrics_port=0, dram=64 << 20)
    server = StoreServer(cfg).start()
    try:
        blocks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (4096, 100_000, 1 << 20, 12_345)]
        keys = [bytes([k]) * 16 for k in range(len(blocks))]
        with Client(f"127.0.0.1:{server.port}") as kv:
            assert all(r.status == "stored" for r in kv.put("ns", keys, blocks, chained=False))
            for _ in range(2):
                out = [torch.zeros_like(b, device=device) if k != 1 else np.zeros(len(b), np.uint8) for k, b in
                       enumerate(blocks)]  # fmt: skip
                got = kv.get("ns", keys, out=out)
                assert all(g is o for g, o in zip(got, out))
                for b, o in zip(blocks, out):
                    assert bytes(o.cpu().numpy() if hasattr(o, "cpu") else o) == bytes(b.numpy())
    finally:
        server.stop(0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="kvikio needs a CUDA driver; none on this machine")
def test_kvikio_backend_reads_into_device_memory(tmp_path):
    from kvstore.tiers.nvme import NvmeTier
    from kvstore.tiers.nvme.io import KvikioBackend

    tier = NvmeTier(tmp_path, 64 << 20, segment_bytes=16 << 20, backend=KvikioBackend())
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    [loc] = tier.write([BlockMeta("ns", b"g" * 16, b"", 0, "uint8", 1 << 20, 1 << 20, 0)], [data])
    out = torch.empty_like(data)
    tier.read([loc], [1 << 20], [out])
    assert torch.equal(out, data)
    tier.close()
