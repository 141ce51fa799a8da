"""kvstore.hugepages: buffers for O_DIRECT in huge pages, checked in the kernel's own accounting (/proc/self/smaps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.hugepages import HUGE_PAGE, PAGE, advise_huge, huge_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def _huge_kib(address: int, nbytes: int) -> int:
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


def _fallbacks() -> int:
    stats = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(stats.get("thp_fault_fallback", 0)) + int(stats.get("thp_collapse_alloc_failed", 0))


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


@pytest.mark.skipif(not _thp_on(), reason="transparent huge pages are off on this kernel")
def test_a_large_buffer_lands_in_huge_pages() -> None:
    before = _fallbacks()
    buf = huge_buffer(4 * HUGE_PAGE)
    buf[::PAGE] = 1
    got = _huge_kib(int(buf.ctypes.data), buf.nbytes)
    if got == 0 and _fallbacks() > before:
        pytest.skip("the kernel had no huge page free")
    assert got == 4 * HUGE_PAGE // 1024


@pytest.mark.skipif(not _thp_on(), reason="transparent huge pages are off on this kernel")
def test_memory_mapped_elsewhere_is_collapsed_into_huge_pages() -> None:
    plain = np.ones(8 * HUGE_PAGE, dtype=np.uint8)  # numpy's own allocation, faulted in as 4 KiB pages
    address = int(plain.ctypes.data)
    before = _fallbacks()
    if not advise_huge(address, plain.nbytes):
        pytest.skip("madvise refused (no MADV_COLLAPSE and no huge page on fault)")
    plain[::PAGE] += 1  # pages faulted before the advice stay 4 KiB unless collapsed
    got = _huge_kib(address, plain.nbytes)
    for _ in range(3):  # MADV_COLLAPSE may leave a range it found busy (EAGAIN: 6 of 7 collapsed once in a suite)
        if got >= 7 * HUGE_PAGE // 1024:
            break
        advise_huge(address, plain.nbytes)
        got = _huge_kib(address, plain.nbytes)
    if got == 0 and _fallbacks() > before:
        pytest.skip("the kernel had no huge page free")
    assert got >= 7 * HUGE_PAGE // 1024  # every whole 2 MiB inside it
    assert int(plain.sum()) == plain.nbytes + plain.nbytes // PAGE  # the contents survive the collapse


def test_advice_on_less_than_a_huge_page_does_nothing() -> None:
    assert not advise_huge(HUGE_PAGE + PAGE, HUGE_PAGE - 2 * PAGE)
