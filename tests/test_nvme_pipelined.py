"""Multi-piece reads on real O_DIRECT files: several pieces in flight, read and checked by one thread each, or
read by pool workers while the caller hands the verified ones on."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.tiers.base import CorruptBlock
from kvstore.tiers.nvme import NvmeTier, PosixBackend, pipeline
from kvstore.tiers.nvme.faults import InstrumentedBackend
from kvstore.tiers.nvme.format import PAGE, split_loc
from kvstore.tiers.nvme.io import aligned_buffer
from tests.test_nvme_tier import flip_byte, read_all, record_checks, segment_files, write_blocks  # noqa: F401

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 128 * KiB  # 32 of them are read in four pieces (64 KiB blocks: two)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(99)


def wiped_dests(n: int) -> list[np.ndarray]:
    dests = [aligned_buffer(BLOCK) for _ in range(n)]
    for d in dests:
        d[:] = 0xAA
    return dests


@pytest.mark.usefixtures("record_checks")
def test_a_bad_record_in_a_later_piece_fails_alone(tmp_path: Path, rng: np.random.Generator) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB, backend=backend)
    blocks = write_blocks(tier, [BLOCK] * 32, rng)
    locs = list(blocks)
    bad = locs[27]  # in the fourth of four pieces
    flip_byte(segment_files(tmp_path)[0], split_loc(bad)[1] + PAGE + 4321)
    dests = wiped_dests(32)
    backend.reset_counts()
    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [BLOCK] * 32, dests)
    assert backend.preads == 4
    assert err.value.locs == [bad]
    for loc, d in zip(locs, dests):
        assert d.tobytes() == (bytes(BLOCK) if loc == bad else blocks[loc])
    tier.close()


def test_a_failed_read_wipes_every_piece(tmp_path: Path, rng: np.random.Generator) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB, backend=backend)
    blocks = write_blocks(tier, [BLOCK] * 32, rng)
    dests = wiped_dests(32)
    backend.fail_reads()
    with pytest.raises(CorruptBlock, match="read failed") as err:
        tier.read(list(blocks), [BLOCK] * 32, dests)
    assert sorted(err.value.locs) == sorted(blocks)
    assert all(not d.any() for d in dests)  # the bytes a failed piece may have landed are gone
    backend.heal()
    tier.read(list(blocks), [BLOCK] * 32, dests)
    assert [d.tobytes() for d in dests] == list(blocks.values())
    tier.close()


@pytest.fixture
def eager_thread_switches():
    """Switch the GIL every 10 us, so readers interleave between taking their buffers."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def test_many_readers_share_a_small_buffer_pool_without_deadlock(
    tmp_path: Path, rng: np.random.Generator, eager_thread_switches: None
) -> None:
    # read_threads=2: pieces two at a time and three bounce buffers for eight readers that each want two
    tier = NvmeTier(tmp_path, 256 * MiB, segment_bytes=32 * MiB, read_threads=2)
    prefixes = [write_blocks(tier, [BLOCK] * 32, rng) for _ in range(4)]
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            dests = [aligned_buffer(BLOCK) for _ in range(32)]
            for i in range(40):
                blocks = prefixes[(k + i) % len(prefixes)]
                tier.read(list(blocks), [BLOCK] * 32, dests)
                assert [d.tobytes() for d in dests] == list(blocks.values())
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "readers stuck: the buffer pool deadlocked"
    assert not errors, errors[0]
    tier.close()


def test_one_read_thread_reads_every_piece_on_the_callers_thread(tmp_path: Path, rng: np.random.Generator) -> None:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(
        tmp_path, 64 * MiB, segment_bytes=16 * MiB, backend=backend, read_threads=1, max_read_bytes=512 * KiB
    )
    blocks = write_blocks(tier, [BLOCK] * 32, rng)
    seen: set[str] = set()
    real = backend.preadv

    def preadv(*args, **kwargs):  # noqa: ANN002, ANN003 (a spy on the backend)
        seen.add(threading.current_thread().name)
        return real(*args, **kwargs)

    backend.preadv = preadv  # type: ignore[method-assign]
    dests = wiped_dests(32)
    tier.read(list(blocks), [BLOCK] * 32, dests)
    assert [d.tobytes() for d in dests] == list(blocks.values())
    assert seen == {threading.current_thread().name}  # nine pieces, no hand-off
    tier.close()


def test_pieces_larger_than_the_bounce_buffers_are_read_whole(tmp_path: Path, rng: np.random.Generator) -> None:
    # 128 KiB bounce buffers, records up to 1 MiB: every thread that takes a big piece swaps in a larger buffer
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB, read_threads=3, max_read_bytes=128 * KiB)
    blocks = write_blocks(tier, [MiB, *[BLOCK] * 6, MiB + 5, 3 * BLOCK, MiB], rng)
    for _ in range(3):
        assert read_all(tier, blocks) == list(blocks.values())
        dests = [aligned_buffer(len(b)) for b in blocks.values()]  # read in place: page aligned
        tier.read(list(blocks), [len(b) for b in blocks.values()], dests)
        assert [d.tobytes() for d in dests] == list(blocks.values())
    assert tier._buffers._free.qsize() == 3 + 1  # every buffer went back (some now larger)
    tier.close()


def test_a_read_does_not_wait_for_a_busy_pool(tmp_path: Path, rng: np.random.Generator) -> None:
    # every pool thread busy (other readers' work): the caller reads all four pieces itself and returns
    tier = NvmeTier(tmp_path, 64 * MiB, segment_bytes=16 * MiB, read_threads=4)
    blocks = write_blocks(tier, [BLOCK] * 32, rng)
    release = threading.Event()
    busy = [tier._pool.submit(release.wait, 30) for _ in range(4)]
    try:
        dests = wiped_dests(32)
        started = time.monotonic()
        tier.read(list(blocks), [BLOCK] * 32, dests)
        assert time.monotonic() - started < 5
        assert [d.tobytes() for d in dests] == list(blocks.values())
        assert tier._buffers._free.qsize() == 4 + 1  # the cancelled jobs' buffers went back
    finally:
        release.set()
        for f in busy:
            f.result()
    tier.close()


# -- a Get with more pieces than readers: the workers read, the caller hands on (pipeline.read_pipelined) --------


@dataclass
class HandOn:
    """32 x 128 KiB records on a tier reading at most 256 KiB a piece (one record each) with two readers: 32
    pieces, more than the readers, so a read with ``on_ready`` and ``on_caller`` is handed on by its caller."""

    backend: InstrumentedBackend
    tier: NvmeTier
    blocks: dict[int, bytes]


@pytest.fixture
def hand_on(tmp_path: Path, rng: np.random.Generator) -> Iterator[HandOn]:
    backend = InstrumentedBackend(PosixBackend())
    tier = NvmeTier(
        tmp_path, 64 * MiB, segment_bytes=16 * MiB, backend=backend, read_threads=2, max_read_bytes=256 * KiB
    )
    yield HandOn(backend, tier, write_blocks(tier, [BLOCK] * 32, rng))
    tier.close()


def spy_reads(backend: InstrumentedBackend) -> list[str]:
    """The names of the threads that issue each preadv, in order."""
    names: list[str] = []
    real = backend.preadv

    def preadv(*args, **kwargs):  # noqa: ANN002, ANN003 (a spy on the backend)
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    backend.preadv = preadv  # type: ignore[method-assign]
    return names


@pytest.mark.usefixtures("record_checks")
def test_workers_read_and_the_caller_hands_each_verified_piece_on(
    tmp_path: Path, hand_on: HandOn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a caller waits STALL_S for its workers before it reads a piece itself: long here, so that a loaded host's
    # slow start of a worker cannot make the caller a reader
    monkeypatch.setattr(pipeline, "STALL_S", 10.0)
    backend, tier, blocks = hand_on.backend, hand_on.tier, hand_on.blocks
    locs = list(blocks)
    bad = locs[20]
    flip_byte(segment_files(tmp_path)[0], split_loc(bad)[1] + PAGE + 777)
    readers = spy_reads(backend)
    dests = wiped_dests(32)
    handed: list[int] = []
    callers: set[str] = set()

    def on_ready(targets: list[int]) -> None:
        callers.add(threading.current_thread().name)
        for t in targets:  # named only once its bytes are verified and in place
            assert dests[t].tobytes() == blocks[locs[t]]
        handed.extend(targets)

    with pytest.raises(CorruptBlock) as err:
        tier.read(locs, [BLOCK] * 32, dests, on_ready, on_caller=True)
    assert err.value.locs == [bad]
    assert sorted(handed) == [t for t in range(32) if t != 20]  # each once, the corrupt one never
    assert callers == {threading.current_thread().name}
    assert len(readers) == 32 and threading.current_thread().name not in readers  # the pool's workers read
    assert tier._buffers._free.qsize() == 2 + 1


def test_a_failed_read_hands_nothing_on(hand_on: HandOn) -> None:
    backend, tier, blocks = hand_on.backend, hand_on.tier, hand_on.blocks
    dests = wiped_dests(32)
    backend.fail_reads()
    handed: list[int] = []
    with pytest.raises(CorruptBlock, match="read failed") as err:
        tier.read(list(blocks), [BLOCK] * 32, dests, handed.extend, on_caller=True)
    assert sorted(err.value.locs) == sorted(blocks) and not handed
    assert all(not d.any() for d in dests)


def test_an_error_handing_on_ends_the_read(hand_on: HandOn) -> None:
    # the lane's copy into a client that went away raises: no piece starts after it, every buffer goes back
    backend, tier, blocks = hand_on.backend, hand_on.tier, hand_on.blocks
    readers = spy_reads(backend)
    failed = threading.Event()
    spied, calls = backend.preadv, itertools.count()

    def gated(*args, **kwargs):  # noqa: ANN002, ANN003
        # two pieces go at once, the rest only once handing on failed: on a loaded host the two workers could
        # otherwise read all 32 before the caller ran its first on_ready
        if next(calls) >= 2:
            failed.wait(10)
        return spied(*args, **kwargs)

    backend.preadv = gated  # type: ignore[method-assign]

    def on_ready(targets: list[int]) -> None:
        failed.set()
        raise OSError("the client went away")

    with pytest.raises(OSError, match="went away"):
        tier.read(list(blocks), [BLOCK] * 32, wiped_dests(32), on_ready, on_caller=True)
    after = len(readers)
    assert after < 32  # the rest were never read
    time.sleep(0.05)
    assert len(readers) == after  # and none is still being started
    assert tier._buffers._free.qsize() == 2 + 1


def test_handing_on_does_not_wait_for_a_busy_pool(hand_on: HandOn) -> None:
    # both pool threads busy with other Gets' work: the caller reads the pieces itself and hands them on
    backend, tier, blocks = hand_on.backend, hand_on.tier, hand_on.blocks
    readers = spy_reads(backend)
    release = threading.Event()
    busy = [tier._pool.submit(release.wait, 30) for _ in range(2)]
    try:
        dests = wiped_dests(32)
        handed: list[int] = []
        started = time.monotonic()
        tier.read(list(blocks), [BLOCK] * 32, dests, handed.extend, on_caller=True)
        assert time.monotonic() - started < 5
        assert sorted(handed) == list(range(32))
        assert [d.tobytes() for d in dests] == list(blocks.values())
        assert set(readers) == {threading.current_thread().name}
        assert tier._buffers._free.qsize() == 2 + 1  # the cancelled jobs' buffers went back
    finally:
        release.set()
        for f in busy:
            f.result()


def test_without_on_caller_each_reader_hands_on_its_own_pieces(hand_on: HandOn) -> None:
    # an on_ready that only wakes another thread (ReadAhead's) is called where the piece was read: no hop
    backend, tier, blocks = hand_on.backend, hand_on.tier, hand_on.blocks
    readers = spy_reads(backend)
    callers: list[str] = []
    dests = wiped_dests(32)
    tier.read(list(blocks), [BLOCK] * 32, dests, lambda targets: callers.extend([threading.current_thread().name]))
    assert [d.tobytes() for d in dests] == list(blocks.values())
    # each piece handed on by the thread that read it (which threads read how many is the scheduler's: on a loaded
    # host the pool's worker can read all 32 before the caller takes one)
    assert len(callers) == 32 and Counter(callers) == Counter(readers)
