"""Faults: ENOSPC and EIO degrade the NVMe tier cleanly (injected, and on real full filesystems)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.tiers.base import BlockMeta, CorruptBlock, TierFault, TierFull
from kvstore.tiers.nvme import NvmeTier, PosixBackend
from kvstore.tiers.nvme import io as nvme_io
from kvstore.tiers.nvme.faults import InstrumentedBackend

KiB, MiB = 1 << 10, 1 << 20


def blocks(rng: np.random.Generator, n: int, size: int) -> tuple[list[BlockMeta], list[bytes]]:
    data = [rng.bytes(size) for _ in range(n)]
    return [BlockMeta("ns", rng.bytes(16), b"", 0, "bfloat16", size, size, 0) for _ in data], data


def read_back(tier: NvmeTier, locs: list[int], data: list[bytes]) -> None:
    dests = [bytearray(len(d)) for d in data]
    tier.read(locs, [len(d) for d in data], dests)
    assert [bytes(d) for d in dests] == data


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_write_fault_discards_the_batch_degrades_and_heals(tmp_path: Path, err: int) -> None:
    rng = np.random.default_rng(err)
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(
        tmp_path, 64 * MiB, segment_bytes=4 * MiB, write_io_bytes=256 * KiB, backend=backend, probe_interval_s=0.3
    )
    m1, d1 = blocks(rng, 10, 100_000)
    locs1 = tier.write(m1, d1)
    used = tier.used_bytes
    backend.fail_writes_after(600 * KiB, err)  # the next batch dies part-way through
    m2, d2 = blocks(rng, 10, 100_000)
    with pytest.raises(TierFault, match=errno.errorcode[err]):
        tier.write(m2, d2)
    s = tier.stats()
    assert s.degraded and errno.errorcode[err] in s.fault
    assert tier.used_bytes == used  # nothing of the batch stays allocated
    pwrites = backend.pwrites
    with pytest.raises(TierFault, match="degraded"):
        tier.write(m2[:1], d2[:1])  # fails fast, no I/O
    assert backend.pwrites == pwrites
    read_back(tier, locs1, d1)  # reads still work
    backend.heal()
    time.sleep(0.35)
    locs3 = tier.write(m2, d2)  # the probe write succeeds: healthy again
    assert not tier.stats().degraded
    read_back(tier, locs1 + locs3, d1 + d2)
    tier.close()
    again = NvmeTier(tmp_path, 64 * MiB, segment_bytes=4 * MiB)
    assert {m.hash for m, _ in again.recover()} == {m.hash for m in m1 + m2}
    again.close()


def test_read_errors_are_reported_as_unreadable_blocks(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 16 * MiB, segment_bytes=4 * MiB, backend=backend)
    m, d = blocks(rng, 4, 10_000)
    locs = tier.write(m, d)
    backend.fail_reads(errno.EIO)
    with pytest.raises(CorruptBlock, match="read failed") as e:
        tier.read(locs, [10_000] * 4, [bytearray(10_000) for _ in locs])
    assert sorted(e.value.locs) == sorted(locs)
    backend.heal()
    read_back(tier, locs, d)
    tier.close()


def test_o_direct_refused_falls_back_to_buffered_with_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct(path, flags, mode=0o777, **kw):  # a filesystem that refuses O_DIRECT
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(nvme_io.os, "open", no_direct)
    rng = np.random.default_rng(4)
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 16 * MiB, segment_bytes=4 * MiB, backend=backend, write_policy="direct")
    m, d = blocks(rng, 5, 50_000)
    locs = tier.write(m, d)
    assert backend.syncs == 1  # buffered data is fdatasync'ed before the ack, whatever the policy
    assert "buffered" in tier.stats().backend
    read_back(tier, locs, d)
    tier.close()


def _mount(kind: str, where: Path, image: Path) -> str | None:
    """Mount a tiny filesystem; returns None or why it could not be done here."""
    where.mkdir()
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)]
    else:
        if shutil.which("mkfs.ext4") is None:
            return "mkfs.ext4 not installed"
        with open(image, "wb") as f:
            f.truncate(16 * MiB)
        mk = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
        if mk.returncode:
            return f"mkfs.ext4 failed: {mk.stderr.strip()}"
        cmd = ["mount", "-o", "loop", str(image), str(where)]
    if os.geteuid() != 0:
        return "mounting needs root"
    r = subprocess.run(cmd, capture_output=True, text=True)
    return f"{' '.join(cmd)} failed: {r.stderr.strip()}" if r.returncode else None


@pytest.fixture(params=["tmpfs", "ext4-loop"])
def tiny_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    where, image = tmp_path / "mnt", tmp_path / "fs.img"
    why = _mount(request.param, where, image)
    if why:
        pytest.skip(f"no tiny {request.param} filesystem here: {why}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_real_enospc_on_a_tiny_filesystem(tiny_fs: Path) -> None:
    rng = np.random.default_rng(5)
    data_dir = tiny_fs / "nvme"
    # the tier believes it may use 64 MiB; the filesystem holds far less
    tier = NvmeTier(data_dir, 64 * MiB, segment_bytes=1 * MiB, probe_interval_s=0.2)
    acked: list[tuple[int, bytes]] = []
    with pytest.raises(TierFault, match="ENOSPC"):
        for _ in range(200):
            m, d = blocks(rng, 4, 200_000)
            acked.extend(zip(tier.write(m, d), d))
    assert tier.stats().degraded and "ENOSPC" in tier.stats().fault
    assert len(acked) >= 8
    locs, data = zip(*acked)
    read_back(tier, list(locs), list(data))  # everything acked is still readable
    # the owner frees a lot; compaction deletes emptied segments even while degraded
    tier.free(list(locs[: len(locs) // 2 + 4]))
    assert tier.compact().segments_dropped > 0
    time.sleep(0.25)
    m, d = blocks(rng, 2, 200_000)
    more = tier.write(m, d)  # the probe succeeds once there is room again
    assert not tier.stats().degraded
    read_back(tier, list(locs[len(locs) // 2 + 4 :]) + more, list(data[len(locs) // 2 + 4 :]) + d)
    tier.close()


def test_tier_full_is_not_a_fault(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    tier = NvmeTier(tmp_path, 2 * MiB, segment_bytes=1 * MiB)
    m, d = blocks(rng, 4, 200_000)
    tier.write(m, d)
    with pytest.raises(TierFull):
        tier.write(*blocks(rng, 4, 200_000))
    assert not tier.stats().degraded
    tier.close()
