"""Physical block allocator of the paged KV pool: a free list and reference counts.

Pure logic, no tensors. Verbs and their promises:

- ``allocate(n) -> ids``: n distinct blocks that were free, each now with
  refcount 1; all or nothing (raises ``OutOfBlocks`` and changes nothing when
  fewer than n are free). Lower ids come out first, so runs are deterministic.
- ``incref(b)``: one more holder of a used block.
- ``decref(b) -> bool``: one holder fewer; True when that was the last one
  and the block went back to the free list.
- ``refcount(b)``, ``num_free``, ``num_used``: accounting; at every moment
  ``num_free + num_used == num_blocks`` and a block is free iff its refcount is 0.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""

    def __init__(self, needed: int, free: int):
        super().__init__(
            f"paged KV pool exhausted: need {needed} free blocks, have {free}; "
            "free finished sequences or build the pool with more blocks"
        )
        self.needed = needed
        self.free = free


class BlockAllocator:
    """Reference-counted allocation of block ids ``0..num_blocks-1``."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() yields low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int = 1) -> list[int]:
        if n < 0:
            raise ValueError("n must be >= 0")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"incref of free block {block}")
        self._refs[block] += 1

    def decref(self, block: int) -> bool:
        refs = self._refs[block]
        if refs <= 0:
            raise ValueError(f"decref of free block {block}")
        self._refs[block] = refs - 1
        if refs == 1:
            self._free.append(block)
            return True
        return False

    def decref_all(self, blocks: Iterable[int]) -> list[int]:
        """Decref each block; returns the ones that became free."""
        return [b for b in blocks if self.decref(b)]

    def free_ids(self) -> list[int]:
        """A copy of the free list (for checks and tests)."""
        return list(self._free)
