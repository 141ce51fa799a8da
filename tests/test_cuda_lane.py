"""The cuda_ipc lane and the device-aware client: `cpu` (the lane's host stand-in) here, `cuda` where a GPU exists.

The in-process lane suites (test_lanes_*.py) run cuda_ipc on its cpu stand-in;
here the real lane runs against a `kvstore serve` process (CUDA cannot open an
IPC handle in the process that made it), with an HBM tier above DRAM.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from kvstore.checksum import crc32c  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.devices import Copier, CrcStaging  # noqa: E402
from kvstore.lanes.base import host_id  # noqa: E402
from kvstore.server.app import hbm_from_fraction  # noqa: E402
from kvstore.server.process import store_process  # noqa: E402
from kvstore.v1 import lanes_pb2 as lpb  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py on a GPU host)"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def kv_blocks(n: int, device: str, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 2, 3, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(n)]


@pytest.fixture(scope="module")
def gpu_store():
    """A store process with an HBM tier above DRAM; its cuda_ipc lane regions live on the GPU."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    with store_process("--hbm", "64MiB", "--dram", "256MiB", "--cuda-lane-bytes", "32MiB") as (target, _):
        yield target


@pytest.mark.parametrize("device", DEVICES)
def test_copier_and_crcs_on_any_device(device):
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8).to(device) for n in (1, 4097, 1 << 20)]
    dst = [torch.empty_like(s) for s in src]
    host = [bytearray(s.numel()) for s in src]
    copier = Copier()
    for d, h, s in zip(dst, host, src):
        copier.copy(d, s)
        copier.copy(h, s)
    copier.settle()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert [bytes(h) for h in host] == [s.cpu().numpy().tobytes() for s in src]
    assert CrcStaging().crcs(dst + host) == [crc32c(s.cpu().numpy()) for s in src] * 2


def test_cuda_ipc_is_not_offered_to_the_servers_own_process(make_server):
    server = make_server(cuda_lane_device="cpu")
    server.lanes.servicer.cuda_device = "cuda:0"  # as on a GPU host; refused before any device is touched
    reasons: list[str] = []
    reply = server.lanes.servicer._open_cuda(lpb.OpenLaneRequest(host_id=host_id(), pid=os.getpid()), reasons, None)
    assert reply is None and "process that made it" in reasons[0]


def test_cuda_ipc_needs_the_same_host(make_server):
    server = make_server()
    reasons: list[str] = []
    assert server.lanes.servicer._open_cuda(lpb.OpenLaneRequest(host_id="elsewhere"), reasons, None) is None
    assert "same host" in reasons[0]


def test_hbm_fraction_is_checked():
    assert hbm_from_fraction("cuda:0", 0.0) == 0
    with pytest.raises(ValueError, match="between 0 and 1"):
        hbm_from_fraction("cuda:0", 1.5)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="no CUDA device"):
            hbm_from_fraction("cuda:0", 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_cuda_ipc_lane_round_trip(make_server, device, request):
    """Host payloads over lane="cuda_ipc": the stand-in here, the GPU region against a store process there."""
    if device == "cuda":
        target = request.getfixturevalue("gpu_store")
    else:
        target = f"127.0.0.1:{make_server().port}"
    blocks = kv_blocks(6, "cpu", seed=1)
    hashes = [bytes([i]) * 16 for i in range(6)]
    with Client(target, lane="cuda_ipc") as kv:
        assert [r.status for r in kv.put("ipc", hashes, blocks)] == ["stored"] * 6
        assert kv.lane_kind == "cuda_ipc"
        out = [torch.empty_like(b) for b in blocks]
        kv.get("ipc", hashes, out=out)
        assert all(torch.equal(o, b) for o, b in zip(out, blocks))
        counters = kv.stats()["counters"]
        assert counters["lane_cuda_ipc_put_bytes"] >= sum(b.numel() * 2 for b in blocks)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py on a GPU host)")
def test_device_tensors_move_device_to_device(gpu_store):
    blocks = kv_blocks(8, "cuda", seed=2)
    hashes = [bytes([7, i]) * 8 for i in range(8)]
    with Client(gpu_store) as kv:  # lane="auto": the cuda_ipc pool is asked because the payloads are on the GPU
        assert [r.status for r in kv.put("dev", hashes, blocks)] == ["stored"] * 8
        assert kv._device_lanes.kind == "cuda_ipc"
        n, tiers = kv.lookup_tiers("dev", hashes)
        assert n == 8 and set(tiers) <= {"hbm", "dram"}
        out = [torch.empty_like(b) for b in blocks]
        kv.get("dev", hashes, out=out)
        assert all(o.device.type == "cuda" and torch.equal(o, b) for o, b in zip(out, blocks))
        fresh = kv.get("dev", hashes[:2])  # no out: the host lanes' bytes
        assert bytes(fresh[0]) == blocks[0].cpu().view(torch.uint8).numpy().tobytes()
        counters = kv.stats()["counters"]
        assert counters["lane_cuda_ipc_get_bytes"] >= sum(b.numel() * 2 for b in blocks)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py on a GPU host)")
def test_blocks_demoted_to_dram_come_back_to_the_gpu(gpu_store):
    """More than the 64 MiB HBM tier: older blocks are demoted to DRAM and are copied host -> region on Get."""
    blocks = [torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda") for _ in range(24)]
    hashes = [bytes([8, i]) * 8 for i in range(24)]
    with Client(gpu_store) as kv:
        assert all(r.ok for r in kv.put("demote", hashes, blocks, chained=False))
        tiers = {t["name"]: t for t in kv.stats()["tiers"]}
        assert tiers["hbm"]["used_bytes"] <= 64 << 20 and tiers["dram"]["used_bytes"] > 0
        out = [torch.empty_like(b) for b in blocks]
        kv.get("demote", hashes, out=out)
        assert all(torch.equal(o, b) for o, b in zip(out, blocks))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py on a GPU host)")
def test_in_process_server_falls_back_to_staging(make_server):
    server = make_server(hbm=32 << 20, cuda_lane_device="")  # the GPU lane device, but the client is in-process
    block = kv_blocks(1, "cuda", seed=3)[0]
    with Client(f"127.0.0.1:{server.port}") as kv:
        kv.put("same", [b"s" * 16], [block])
        out = torch.empty_like(block)
        kv.get("same", [b"s" * 16], out=[out])
        assert torch.equal(out, block) and kv._device_lanes.kind == "grpc"


@pytest.mark.parametrize("sizes", [[0], [1, 4095, 4096, 4097], [3 * 4096 + 5, 100_000, 8192]])
def test_chunked_crc_math_equals_crc32c(sizes):
    """The GPU kernel's algorithm (chunks, fold, all-ones fix-up) with chunk CRCs from the CPU library."""
    from kvstore.crc_gpu import reference_crcs

    buffers = [os.urandom(n) for n in sizes]
    assert reference_crcs(buffers) == [crc32c(b) for b in buffers]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine (run bench/gpu_check.py on a GPU host)")
def test_gpu_crc32c_equals_the_cpu():
    from kvstore.crc_gpu import gpu_crc32c

    gpu = gpu_crc32c()
    if gpu is None:
        pytest.skip("cupy (the gpu extra) is not installed")
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for n in (0, 1, 4097, 2 << 20, 77_777)]
    data.append(torch.randint(0, 256, (5000,), dtype=torch.uint8, device="cuda")[3:])  # unaligned start
    assert gpu.crcs(data) == [crc32c(d.cpu().numpy()) for d in data]
