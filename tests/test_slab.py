"""Slab allocator properties: no overlap, bounded capacity, pages return to the pool."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.slab import ALIGN, SlabAllocator, default_classes

PAGE = 1 << 20


def test_classes_cover_powers_of_two_and_are_aligned():
    classes = default_classes(8 << 20)
    assert all(c % ALIGN == 0 for c in classes) and classes == sorted(set(classes))
    assert {64 << 10, 512 << 10, 2 << 20, 8 << 20} <= set(classes)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, PAGE)), max_size=200))
def test_allocations_never_overlap_and_stay_in_bounds(ops):
    slab = SlabAllocator(8 * PAGE, PAGE)
    live: dict[int, int] = {}
    for alloc, size in ops:
        if alloc or not live:
            off = slab.allocate(size)
            if off is None:
                assert not slab.can_allocate(size)
                continue
            assert off % ALIGN == 0 and off + size <= slab.capacity
            assert slab.slot_size(off) >= size
            live[off] = slab.slot_size(off)
        else:
            off = next(iter(live))
            slab.free(off)
            del live[off]
        spans = sorted(live.items())
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:])), "overlapping slots"
        assert slab.used_bytes == sum(live.values()) <= slab.capacity
    for off in list(live):
        slab.free(off)
    assert slab.used_bytes == 0 and len(slab._free_pages) == slab.n_pages


def test_double_free_is_refused():
    slab = SlabAllocator(4 * PAGE, PAGE)
    off = slab.allocate(5000)
    other = slab.allocate(5000)
    slab.free(off)
    try:
        slab.free(off)
    except ValueError:
        pass
    else:
        raise AssertionError("double free accepted")
    slab.free(other)
