"""Slab allocator: carves one fixed buffer [0, capacity) into pages, each page into
equal slots of one size class (memcached-style), so blocks of a few common sizes
pack without external fragmentation and no per-block allocation happens.

Verbs: ``allocate(nbytes) -> offset | None`` (None: no free slot of that class and
no free page), ``free(offset)``, ``slot_size(offset)``. A page whose slots are all
free goes back to the shared page pool, so classes rebalance as the mix changes.
Offsets are multiples of ``align`` (4 KiB: O_DIRECT-friendly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALIGN = 4096


def default_classes(page_size: int, min_size: int = ALIGN, growth: float = 1.25) -> list[int]:
    """Geometric size classes (rounded to ALIGN) plus every power of two, up to page_size."""
    sizes = set()
    size = float(min_size)
    while size < page_size:
        sizes.add(-(-int(size) // ALIGN) * ALIGN)
        size *= growth
    p = min_size
    while p <= page_size:
        sizes.add(p)
        p *= 2
    sizes.add(page_size)
    return sorted(s for s in sizes if s <= page_size)


@dataclass
class _Page:
    size_class: int = -1  # index into classes, -1 when in the free pool
    free_slots: list[int] = field(default_factory=list)
    taken: bytearray = field(default_factory=bytearray)  # 1 per allocated slot: catches double frees
    used: int = 0


class SlabAllocator:
    def __init__(self, capacity: int, page_size: int, classes: list[int] | None = None):
        if page_size % ALIGN or page_size <= 0:
            raise ValueError(f"page size must be a positive multiple of {ALIGN}")
        self.page_size = page_size
        self.classes = classes or default_classes(page_size)
        self.n_pages = capacity // page_size
        self.capacity = self.n_pages * page_size
        self._pages = [_Page() for _ in range(self.n_pages)]
        self._free_pages = list(range(self.n_pages - 1, -1, -1))
        self._partial: list[dict[int, None]] = [{} for _ in self.classes]  # pages with a free slot
        self.used_bytes = 0

    @property
    def max_slot(self) -> int:
        return self.classes[-1]

    def class_of(self, nbytes: int) -> int:
        lo, hi = 0, len(self.classes)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.classes[mid] >= nbytes:
                hi = mid
            else:
                lo = mid + 1
        if lo == len(self.classes):
            raise ValueError(f"{nbytes} bytes exceeds the largest slot ({self.max_slot})")
        return lo

    def allocate(self, nbytes: int) -> int | None:
        cls = self.class_of(max(nbytes, 1))
        partial = self._partial[cls]
        if partial:
            page_no = next(iter(partial))
        elif self._free_pages:
            page_no = self._free_pages.pop()
            page = self._pages[page_no]
            page.size_class = cls
            per_page = self.page_size // self.classes[cls]
            page.free_slots = list(range(per_page - 1, -1, -1))
            page.taken = bytearray(per_page)
            partial[page_no] = None
        else:
            return None
        page = self._pages[page_no]
        slot = page.free_slots.pop()
        page.taken[slot] = 1
        page.used += 1
        if not page.free_slots:
            del partial[page_no]
        size = self.classes[cls]
        self.used_bytes += size
        return page_no * self.page_size + slot * size

    def slot_size(self, offset: int) -> int:
        return self.classes[self._pages[offset // self.page_size].size_class]

    def free(self, offset: int) -> None:
        page_no, within = divmod(offset, self.page_size)
        page = self._pages[page_no]
        if page.size_class < 0:
            raise ValueError(f"free of offset {offset} in an unassigned page")
        size = self.classes[page.size_class]
        slot = within // size
        if within % size or slot >= len(page.taken) or not page.taken[slot]:
            raise ValueError(f"bad free of offset {offset}")
        page.taken[slot] = 0
        page.free_slots.append(slot)
        page.used -= 1
        self.used_bytes -= size
        partial = self._partial[page.size_class]
        if page.used == 0:
            partial.pop(page_no, None)
            page.size_class, page.free_slots, page.taken = -1, [], bytearray()
            self._free_pages.append(page_no)
        else:
            partial[page_no] = None

    def can_allocate(self, nbytes: int) -> bool:
        return bool(self._partial[self.class_of(max(nbytes, 1))] or self._free_pages)
