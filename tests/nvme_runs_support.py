"""Real NVMe tiers of a few small segments for the tests of its compiled runs (test_nvme_runs, test_send_runs):
records written through the tier, and a payload damaged on disk as a bad sector would."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.format import HEADER_BYTES, crc32c, split_loc

KiB, MiB = 1 << 10, 1 << 20


def make_tier(root: Path, backend=None) -> NvmeTier:
    more = {} if backend is None else {"backend": backend}
    return NvmeTier(root, 64 * MiB, segment_bytes=4 * MiB, write_io_bytes=256 * KiB, **more)


def write(tier: NvmeTier, payloads: list[np.ndarray], rng: np.random.Generator) -> list[int]:
    metas = [BlockMeta("ns", rng.bytes(16), b"", 0, "uint8", len(p), len(p), crc32c(p)) for p in payloads]
    return tier.write(metas, payloads)


def written(root: Path, sizes: list[int], count: int, seed: int) -> tuple[NvmeTier, list[int], list[np.ndarray]]:
    """``count`` records of ``sizes`` in turn, random bytes, over segments of 4 MiB (some runs cross an end)."""
    tier = make_tier(root)
    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, sizes[k % len(sizes)], dtype=np.uint8) for k in range(count)]
    return tier, write(tier, payloads, rng), payloads


def damage(root: Path, loc: int, at: int = 100) -> None:
    """Flip the payload byte ``at`` of the record at ``loc`` in its segment file."""
    seg, offset = split_loc(loc)
    with open(root / f"seg-{seg:010d}.log", "r+b") as f:
        f.seek(offset + HEADER_BYTES + at)
        byte = f.read(1)
        f.seek(offset + HEADER_BYTES + at)
        f.write(bytes([byte[0] ^ 0xFF]))
