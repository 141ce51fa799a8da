"""kvstore.hugepages: buffers for O_DIRECT in huge pages, checked in the kernel's own accounting (/proc/self/smaps),
and which directories give their shared files huge pages."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore import hugepages, shmfile
from kvstore.config import ServeConfig
from kvstore.hugepages import (
    HUGE_PAGE,
    PAGE,
    advise_huge,
    advise_huge_ranges,
    anonymous_huge_pages,
    files_get_huge_pages,
    huge_buffer,
    huge_pages_of_mount,
)
from kvstore.server.app import build_tiers


def thp_on() -> bool:
    return anonymous_huge_pages() is True


def huge_kib(address: int, nbytes: int) -> int:
    """AnonHugePages of the mappings over ``nbytes`` at ``address`` (advice splits a mapping where it starts)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + nbytes and address < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def fallbacks() -> int:
    stats = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(stats.get("thp_fault_fallback", 0)) + int(stats.get("thp_collapse_alloc_failed", 0))


def skip_if_the_kernel_ran_short(got_kib: int, want_kib: int, fallbacks_before: int) -> None:
    """Skip where fewer huge pages landed than wanted and the kernel counted one it could not give (a busy CI
    host): a shortfall with no such count is ours and fails the test."""
    if got_kib < want_kib and fallbacks() > fallbacks_before:
        pytest.skip(f"the kernel had no huge page free for {want_kib - got_kib} KiB")


@pytest.mark.parametrize("nbytes", [0, 1, PAGE, 64 << 10, HUGE_PAGE - PAGE, HUGE_PAGE, 5 * HUGE_PAGE + 123])
def test_a_buffer_is_zeroed_page_aligned_and_exactly_as_long(nbytes: int) -> None:
    buf = huge_buffer(nbytes)
    assert buf.dtype == np.uint8 and len(buf) == nbytes and buf.flags.writeable and buf.flags.c_contiguous
    assert int(buf.ctypes.data) % (HUGE_PAGE if nbytes >= HUGE_PAGE else PAGE) == 0
    assert not buf.any()
    buf[:] = 7  # all of it is memory of ours
    assert int(buf.sum()) == 7 * nbytes


def test_whole_pages_align_a_small_buffer_to_a_huge_page() -> None:
    buf = huge_buffer(100, whole_pages=True)
    assert len(buf) == 100 and int(buf.ctypes.data) % HUGE_PAGE == 0


@pytest.mark.skipif(not thp_on(), reason="transparent huge pages are off on this kernel")
def test_a_large_buffer_lands_in_huge_pages() -> None:
    before = fallbacks()
    buf = huge_buffer(4 * HUGE_PAGE)
    buf[::PAGE] = 1
    got = huge_kib(int(buf.ctypes.data), buf.nbytes)
    skip_if_the_kernel_ran_short(got, 4 * HUGE_PAGE // 1024, before)
    assert got == 4 * HUGE_PAGE // 1024


@pytest.mark.skipif(not thp_on(), reason="transparent huge pages are off on this kernel")
def test_memory_mapped_elsewhere_is_collapsed_into_huge_pages() -> None:
    plain = np.ones(8 * HUGE_PAGE, dtype=np.uint8)  # numpy's own allocation, faulted in as 4 KiB pages
    address = int(plain.ctypes.data)
    before = fallbacks()
    if not advise_huge(address, plain.nbytes):
        pytest.skip("madvise refused (no MADV_COLLAPSE and no huge page on fault)")
    plain[::PAGE] += 1  # pages faulted before the advice stay 4 KiB unless collapsed
    got = huge_kib(address, plain.nbytes)
    for _ in range(3):  # MADV_COLLAPSE may leave a range it found busy (EAGAIN: 6 of 7 collapsed once in a suite)
        if got >= 7 * HUGE_PAGE // 1024:
            break
        advise_huge(address, plain.nbytes)
        got = huge_kib(address, plain.nbytes)
    skip_if_the_kernel_ran_short(got, 7 * HUGE_PAGE // 1024, before)
    assert got >= 7 * HUGE_PAGE // 1024  # every whole 2 MiB inside it
    assert int(plain.sum()) == plain.nbytes + plain.nbytes // PAGE  # the contents survive the collapse


def test_a_collapse_the_kernel_finds_busy_is_asked_again_and_other_refusals_are_not(monkeypatch) -> None:
    errors: list[int] = []  # what each MADV_COLLAPSE answers: 0 took, else its errno
    collapses = [0]
    last = [0]

    def madvise(address: int, nbytes: int, advice: int) -> int:
        if advice != hugepages.MADV_COLLAPSE:
            return -1  # no MADV_HUGEPAGE either: only a collapse makes the advice take
        collapses[0] += 1
        last[0] = errors.pop(0)
        return 0 if last[0] == 0 else -1

    monkeypatch.setattr(hugepages, "madvise", madvise)
    monkeypatch.setattr(hugepages.ctypes, "get_errno", lambda: last[0])
    for answers, took, asked in [
        ([errno.EAGAIN, errno.EAGAIN, 0], True, 3),  # busy twice, then done
        ([errno.ENOMEM], False, 1),  # no huge page free: asking again at once would not help
        ([errno.EAGAIN] * hugepages.COLLAPSE_TRIES, False, hugepages.COLLAPSE_TRIES),  # busy every time
    ]:
        errors[:], collapses[0] = answers, 0
        assert advise_huge(0, HUGE_PAGE) is took
        assert collapses[0] == asked and errors == []


def test_advice_on_less_than_a_huge_page_does_nothing() -> None:
    assert not advise_huge(HUGE_PAGE + PAGE, HUGE_PAGE - 2 * PAGE)


def test_ranges_are_advised_a_chunk_at_a_time_over_their_whole_huge_pages(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(hugepages, "advise_huge", lambda a, n: calls.append((a, n)) or a != 40 * HUGE_PAGE)
    ranges = [(10 * HUGE_PAGE + PAGE, 7 * HUGE_PAGE), (40 * HUGE_PAGE, 3 * HUGE_PAGE + 5), (90 * HUGE_PAGE, PAGE)]
    took, refused = advise_huge_ranges(ranges, chunk=2 * HUGE_PAGE)
    assert calls == [
        (11 * HUGE_PAGE, 2 * HUGE_PAGE),
        (13 * HUGE_PAGE, 2 * HUGE_PAGE),
        (15 * HUGE_PAGE, 2 * HUGE_PAGE),  # it ends a page past 17: whole pages 11 to 16
        (40 * HUGE_PAGE, 2 * HUGE_PAGE),
        (42 * HUGE_PAGE, HUGE_PAGE),
    ]  # and nothing for a range inside one huge page
    assert (took, refused) == (7 * HUGE_PAGE, 2 * HUGE_PAGE)


def test_a_stop_ends_the_advice_between_chunks(monkeypatch) -> None:
    stop = threading.Event()
    calls: list[int] = []

    def advise(address: int, nbytes: int) -> bool:
        calls.append(address)
        stop.set()
        return True

    monkeypatch.setattr(hugepages, "advise_huge", advise)
    assert advise_huge_ranges([(0, 8 * HUGE_PAGE)], stop, chunk=HUGE_PAGE) == (HUGE_PAGE, 0)
    assert calls == [0]


# /proc/self/mountinfo lines: id parent dev root mount-point options [optional...] - fstype source super-options
MOUNTS = "\n".join(
    [
        "21 1 0:19 / / rw,relatime - ext4 /dev/vda rw",
        "25 21 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=8g",
        "26 21 0:22 / /mnt/huge rw - tmpfs tmpfs rw,size=4g,huge=within_size",
        "27 21 0:23 / /mnt/never rw - tmpfs tmpfs rw,huge=never",
        "28 21 0:24 / /dev/hugepages rw - hugetlbfs hugetlbfs rw,pagesize=2M",
        "29 26 0:25 / /mnt/huge/plain rw - tmpfs tmpfs rw",
        "30 21 0:26 / /mnt/with\\040space rw - tmpfs tmpfs rw,huge=always",
    ]
)


@pytest.mark.parametrize(
    ("path", "shmem", "expected"),
    [
        ("/dev/shm", "", False),  # a tmpfs without huge=: 4 KiB pages whatever is advised
        ("/dev/shm/kvstore-dram-1", "always within_size advise [never] deny force", False),
        ("/mnt/hugeother", "", False),  # not under /mnt/huge: the root's ext4
        ("/mnt/huge/arena", "", True),
        ("/mnt/huge/plain/arena", "", False),  # the mount on top decides
        ("/mnt/never", "", False),
        ("/dev/hugepages/x", "", True),
        ("/mnt/with space/x", "", True),
        ("/work/data", "", False),  # not a tmpfs
        ("/dev/shm", "always within_size advise never deny [force]", True),
        ("/mnt/huge", "always within_size advise never [deny] force", False),
    ],
)
def test_which_directories_give_their_files_huge_pages(path: str, shmem: str, expected: bool) -> None:
    assert huge_pages_of_mount(MOUNTS, path, shmem) is expected


def test_a_path_no_mount_holds_is_unknown() -> None:
    assert huge_pages_of_mount(MOUNTS.split("\n", 1)[1], "/work/data") is None


def _shmem_pmd_kib(address: int) -> int:
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
            total += int(line.split()[1])
    return total


def test_a_directory_said_to_give_small_pages_does(tmp_path: Path) -> None:
    # the kernel's own accounting of a shared file's mapping, as the DRAM arena makes it (the other way round is
    # not checked: a tmpfs allowed huge pages may still find no free 2 MiB of memory)
    directory = "/dev/shm" if Path("/dev/shm").is_dir() else str(tmp_path)
    if files_get_huge_pages(directory) is not False:
        pytest.skip(f"{directory} may give huge pages here")
    path, mapping = shmfile.create(directory, "kvstore-test-", 4 * HUGE_PAGE)
    try:
        view = np.frombuffer(mapping, dtype=np.uint8)
        view[::PAGE] = 1  # every page faulted in
        assert _shmem_pmd_kib(view.ctypes.data) == 0
        del view
    finally:
        mapping.close()
        Path(path).unlink()


def test_a_store_sharing_dram_on_small_pages_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if files_get_huge_pages(str(tmp_path)) is not False:
        pytest.skip("the test directory may give huge pages here")
    shared = dict(share_dram=True, shm_dir=str(tmp_path), dram=8 << 20, dram_index=False)
    with caplog.at_level("WARNING", logger="kvstore.server"):
        tiers = build_tiers(ServeConfig(**shared))  # no NVMe tier: nothing is read into the arena from disk
        assert "4 KiB pages" not in caplog.text
        tiers += build_tiers(
            ServeConfig(**shared, nvme_dir=str(tmp_path / "nvme"), nvme=64 << 20, nvme_segment=16 << 20)
        )
    for tier in tiers:
        tier.close()
    assert "4 KiB pages" in caplog.text and "--shm-dir" in caplog.text


@pytest.mark.parametrize(
    ("enabled", "huge"),
    [("always [madvise] never\n", True), ("[always] madvise never\n", True), ("always madvise [never]\n", False)],
)
def test_private_memory_gets_huge_pages_unless_thp_is_never(enabled: str, huge: bool) -> None:
    assert anonymous_huge_pages(enabled) is huge
