"""GPUDirect Storage reads (kvstore/tiers/nvme/gds.py): NVMe records straight into CUDA tensors through kvikio.

kvikio needs a CUDA driver, so these run only on a GPU host (bench/gpu_check.py
runs them there); here they are skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_nvme_kvikio import _why_not  # kvikio installed and a CUDA device present

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(bool(_why_not()), reason=f"GDS reads need kvikio and a CUDA device: {_why_not()}"),
]


def _tier(path: Path):
    from kvstore.tiers.nvme import KvikioBackend, NvmeTier

    return NvmeTier(path, 64 << 20, segment_bytes=16 << 20, backend=KvikioBackend())


def _blocks(n: int):
    import torch

    from kvstore.checksum import crc32c
    from kvstore.tiers.base import BlockMeta

    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for size in (5000, 1 << 20, 4096, 77)][:n]
    metas = [
        BlockMeta("ns", bytes([i]) * 16, b"", 0, "uint8", d.numel(), d.numel(), crc32c(d.numpy()))
        for i, d in enumerate(data)
    ]
    return data, metas


def test_records_land_in_device_memory(tmp_path: Path) -> None:
    import torch

    tier = _tier(tmp_path)
    data, metas = _blocks(4)
    locs = tier.write(metas, [d.numpy() for d in data])
    outs = [torch.full((d.numel(),), 7, dtype=torch.uint8, device="cuda") for d in data]
    tier.read(locs, [d.numel() for d in data], outs)
    assert all(torch.equal(o.cpu(), d) for o, d in zip(outs, data))
    assert tier.stats().backend in ("kvikio-gds", "kvikio-compat")
    tier.close()


def test_a_flipped_byte_is_caught_and_the_device_buffer_zeroed(tmp_path: Path) -> None:
    import torch

    from kvstore.tiers.base import CorruptBlock
    from kvstore.tiers.nvme.format import HEADER_BYTES, split_loc
    from kvstore.tiers.nvme.segments import segment_path

    tier = _tier(tmp_path)
    data, metas = _blocks(2)
    locs = tier.write(metas, [d.numpy() for d in data])  # on the device once write returns (O_DIRECT)
    seg_id, offset = split_loc(locs[1])
    with open(segment_path(tmp_path, seg_id), "r+b") as f:
        f.seek(offset + HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(offset + HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    outs = [torch.full((d.numel(),), 7, dtype=torch.uint8, device="cuda") for d in data]
    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [d.numel() for d in data], outs)
    assert locs[1] in err.value.locs
    assert torch.equal(outs[0].cpu(), data[0]) and int(outs[1].count_nonzero()) == 0
    tier.close()
