"""The kvikio (GPUDirect Storage) backend: a round trip through CuFile into host and device buffers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from kvstore.tiers.nvme.io import cuda_device_present


def _why_not() -> str:
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed"
    if not cuda_device_present():
        return "no CUDA device"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_not()), reason=f"kvikio backend needs kvikio and a CUDA device: {_why_not()}")


def test_kvikio_backend_round_trip(tmp_path: Path) -> None:
    from kvstore.tiers.base import BlockMeta
    from kvstore.tiers.nvme import KvikioBackend, NvmeTier
    from kvstore.tiers.nvme.format import crc32c

    backend = KvikioBackend()
    assert backend.name in ("kvikio-gds", "kvikio-compat")
    tier = NvmeTier(tmp_path, 64 << 20, segment_bytes=8 << 20, backend=backend)
    assert tier.stats().backend.startswith("kvikio")
    rng = np.random.default_rng(0)
    data = [rng.bytes(n) for n in (4096, 100_000, 1 << 20)]
    metas = [BlockMeta("ns", rng.bytes(16), b"", 0, "bfloat16", len(d), len(d), crc32c(d)) for d in data]
    locs = tier.write(metas, data)
    dests = [bytearray(len(d)) for d in data]
    tier.read(locs, [len(d) for d in data], dests)
    assert [bytes(d) for d in dests] == data
    import torch

    dev = [torch.empty(len(d), dtype=torch.uint8, device="cuda") for d in data]
    tier.read(locs, [len(d) for d in data], dev)
    assert [t.cpu().numpy().tobytes() for t in dev] == data
    tier.close()
