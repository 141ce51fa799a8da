"""Recovery of the NVMe tier: torn tails, garbage, lost summaries, checkpoints, and a real kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.tiers.base import BlockMeta, CorruptBlock
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.format import PAGE, crc32c, record_bytes, split_loc

KiB, MiB = 1 << 10, 1 << 20
ROOT = Path(__file__).resolve().parent.parent


def payload_for(h: bytes, n: int) -> bytes:
    return np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(n)


def make_blocks(rng: np.random.Generator, sizes: list[int], ns: str = "ns") -> list[tuple[BlockMeta, bytes]]:
    out = []
    for n in sizes:
        h = rng.bytes(16)
        data = payload_for(h, n)
        out.append((BlockMeta(ns, h, rng.bytes(16), 1, "float16", 2 * n, n, 7), data))
    return out


def write(tier: NvmeTier, blocks: list[tuple[BlockMeta, bytes]]) -> list[int]:
    return tier.write([m for m, _ in blocks], [d for _, d in blocks])


def recovered(tier: NvmeTier) -> dict[bytes, tuple[BlockMeta, int]]:
    return {m.hash: (m, loc) for m, loc in tier.recover()}


def check_bytes(tier: NvmeTier, found: dict[bytes, tuple[BlockMeta, int]]) -> None:
    items = list(found.values())
    dests = [bytearray(m.stored_length) for m, _ in items]
    tier.read([loc for _, loc in items], [m.stored_length for m, _ in items], dests)
    for (m, _), d in zip(items, dests):
        assert bytes(d) == payload_for(m.hash, m.stored_length)


def open_tier(d: Path, **kw) -> NvmeTier:
    return NvmeTier(d, 256 * MiB, segment_bytes=kw.pop("segment_bytes", 4 * MiB), **kw)


def crash_state(d: Path) -> None:
    """What a crash leaves behind: no checkpoint, and no summary for the segment that was active."""
    (d / "checkpoint").unlink(missing_ok=True)
    last = sorted(d.glob("seg-*.log"))[-1]
    last.with_suffix(".sum").unlink(missing_ok=True)


def test_clean_reopen_recovers_everything_from_summaries(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tier = open_tier(tmp_path)
    blocks = make_blocks(rng, [int(n) for n in rng.integers(0, 300_000, 60)])
    for i in range(0, 60, 10):
        write(tier, blocks[i : i + 10])
    tier.close()
    again = open_tier(tmp_path)
    found = recovered(again)
    assert {m.hash: m for m, _ in blocks} == {h: m for h, (m, _) in found.items()}
    check_bytes(again, found)
    assert again.stats().extra["recovery_seconds"] < 1.0
    again.close()


@pytest.mark.parametrize("damage", ["truncate_mid_payload", "truncate_mid_header", "garbage_after", "zero_tail"])
def test_torn_tail_is_skipped(tmp_path: Path, damage: str) -> None:
    rng = np.random.default_rng(2)
    tier = open_tier(tmp_path)
    blocks = make_blocks(rng, [50_000] * 12)
    locs = write(tier, blocks[:6]) + write(tier, blocks[6:])
    tier.close()
    crash_state(tmp_path)
    seg = tmp_path / "seg-0000000001.log"
    last_off = split_loc(locs[-1])[1]
    end = last_off + PAGE + 53_248  # record_bytes(50_000)
    if damage == "truncate_mid_payload":
        os.truncate(seg, last_off + PAGE + 20_000)
    elif damage == "truncate_mid_header":
        os.truncate(seg, last_off + 50)
    elif damage == "garbage_after":
        with open(seg, "r+b") as f:
            f.seek(end)
            f.write(np.random.default_rng(3).bytes(3 * PAGE))
    else:  # the last record's payload never reached the disk
        with open(seg, "r+b") as f:
            f.seek(last_off + PAGE)
            f.write(bytes(50_000))
    again = open_tier(tmp_path)
    found = recovered(again)
    want = blocks if damage == "garbage_after" else blocks[:-1]
    assert set(found) == {m.hash for m, _ in want}
    check_bytes(again, found)
    again.close()


def test_damage_in_the_middle_of_an_unsummarised_segment_stops_its_scan(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    tier = open_tier(tmp_path)
    blocks = make_blocks(rng, [30_000] * 10)
    locs = write(tier, blocks)
    tier.close()
    crash_state(tmp_path)
    with open(tmp_path / "seg-0000000001.log", "r+b") as f:
        f.seek(split_loc(locs[4])[1] + PAGE + 100)
        f.write(b"\x00\x01\x02")
    again = open_tier(tmp_path)
    found = recovered(again)
    assert set(found) == {m.hash for m, _ in blocks[:4]}  # nothing after a bad record is trusted
    again.close()


def test_a_damaged_summary_falls_back_to_a_scan(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    tier = open_tier(tmp_path, segment_bytes=1 * MiB)
    blocks = make_blocks(rng, [100_000] * 25)
    for i in range(0, 25, 5):
        write(tier, blocks[i : i + 5])
    tier.close()
    summaries = sorted(tmp_path.glob("seg-*.sum"))
    assert len(summaries) == len(list(tmp_path.glob("seg-*.log"))) >= 3
    with open(summaries[0], "r+b") as f:
        f.seek(40)
        f.write(b"XX")
    again = NvmeTier(tmp_path, 256 * MiB, segment_bytes=1 * MiB)
    found = recovered(again)
    assert set(found) == {m.hash for m, _ in blocks}
    check_bytes(again, found)
    again.close()


def test_later_record_supersedes_and_frees_persist_at_checkpoint(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    tier = open_tier(tmp_path)
    blocks = make_blocks(rng, [10_000] * 6)
    locs = write(tier, blocks)
    m0 = blocks[0][0]
    newer = BlockMeta(m0.namespace, m0.hash, m0.parent, 0, "float16", 10_000, 10_000, crc32c(blocks[0][1]))
    write(tier, [(newer, blocks[0][1])])  # same key again, different codec: the later one wins
    tier.free(locs[1:3])
    tier.close()
    again = open_tier(tmp_path)
    found = recovered(again)
    assert set(found) == {m.hash for m, _ in blocks[:1] + blocks[3:]}
    assert found[m0.hash][0] == newer
    again.close()


def test_frees_after_the_last_checkpoint_come_back_with_valid_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tier = open_tier(tmp_path)
    blocks = make_blocks(rng, [10_000] * 6)
    locs = write(tier, blocks)
    tier.checkpoint()
    tier.free(locs[:2])
    tier.close()
    crash_state(tmp_path)  # the close's checkpoint is lost with the crash
    again = open_tier(tmp_path)
    found = recovered(again)
    assert set(found) == {m.hash for m, _ in blocks}
    check_bytes(again, found)
    again.close()


def test_a_crash_in_the_middle_of_compaction_keeps_one_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    moved: list[tuple[int, int]] = []

    def hook(pairs: list[tuple[int, int]]) -> None:
        moved.extend(pairs)
        raise RuntimeError("the owner died before the old segment was deleted")

    d = tmp_path / "live"
    tier = NvmeTier(d, 64 * MiB, segment_bytes=1 * MiB, on_relocate=hook)
    blocks = make_blocks(rng, [100_000] * 20)
    locs = write(tier, blocks)
    tier.free(locs[:7])  # the first segment (9 records) is mostly dead
    with pytest.raises(RuntimeError):
        tier.compact(max_segments=1)
    assert len(moved) == 2
    crashed = tmp_path / "crashed"
    shutil.copytree(d, crashed)  # the files as a crash right now would leave them
    tier.close()
    again = NvmeTier(crashed, 64 * MiB, segment_bytes=1 * MiB)
    found = recovered(again)
    assert len(found) == 20  # the freed ones come back (frees were not checkpointed), once each
    assert {found[blocks[i][0].hash][1] for i in (7, 8)} == {new for _, new in moved}  # the copies win
    check_bytes(again, found)
    assert again.used_bytes == 20 * record_bytes(100_000)  # the losing old copies count as dead
    again.close()


WRITER = r"""
import json, sys, numpy as np
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier
d, seed = sys.argv[1], int(sys.argv[2])
tier = NvmeTier(d, 1 << 30, segment_bytes=8 << 20, write_io_bytes=1 << 20)
rng = np.random.default_rng(seed)
out = sys.stdout
while True:
    batch = []
    for _ in range(int(rng.integers(1, 12))):
        h, n = rng.bytes(16), int(rng.integers(1, 400_000))
        batch.append((BlockMeta("crash", h, b"", 0, "bfloat16", n, n, 0),
                      np.random.default_rng(int.from_bytes(h[:8], "little")).bytes(n)))
    tier.write([m for m, _ in batch], [p for _, p in batch])
    out.write(json.dumps([[m.hash.hex(), m.stored_length] for m, _ in batch]) + "\n")
    out.flush()
"""


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_kill_9_mid_burst_loses_no_acknowledged_block(tmp_path: Path, seed: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(seed)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked: dict[bytes, int] = {}
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    while len(acked) < 400 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"writer died: {proc.stderr.read() if proc.stderr else ''}")
        acked.update((bytes.fromhex(h), n) for h, n in json.loads(line))
    time.sleep(np.random.default_rng(seed).uniform(0, 0.004))  # land somewhere inside the next burst
    os.kill(proc.pid, signal.SIGKILL)
    for line in proc.stdout:  # acks printed before the kill landed
        if line.endswith("\n"):
            acked.update((bytes.fromhex(h), n) for h, n in json.loads(line))
    proc.wait()
    assert len(acked) >= 400
    tier = NvmeTier(tmp_path, 1 << 30, segment_bytes=8 << 20)
    found = recovered(tier)
    missing = [h.hex() for h in acked if h not in found]
    assert not missing, f"{len(missing)} acknowledged blocks lost"
    for h, n in acked.items():
        assert found[h][0].stored_length == n
    try:
        check_bytes(tier, found)  # every recovered block, acked or not, has the right bytes
    except CorruptBlock as e:
        pytest.fail(f"recovered records fail verification: {e}")
    tier.close()


def test_recovery_of_many_small_blocks_is_fast(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    tier = NvmeTier(tmp_path, 1 << 30, segment_bytes=32 * MiB, write_policy="direct")
    n, size = 10_000, 4 * KiB
    data = rng.bytes(size)
    for _ in range(0, n, 500):
        metas = [BlockMeta("ns", rng.bytes(16), b"", 0, "bfloat16", size, size, 0) for _ in range(500)]
        tier.write(metas, [data] * 500)
    tier.close()
    crash_state(tmp_path)  # one segment must be scanned record by record
    t0 = time.perf_counter()
    again = NvmeTier(tmp_path, 1 << 30, segment_bytes=32 * MiB)
    count = sum(1 for _ in again.recover())
    seconds = time.perf_counter() - t0
    assert count == n
    # loose (0.34 s on the 2-core dev VM) so that a loaded CI host passes it: the speed itself is bench.nvme_recovery's
    assert seconds < 10.0, f"recovering {n} blocks took {seconds:.2f} s"
    again.close()
