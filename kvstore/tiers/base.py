"""The tier interface: every storage tier speaks these verbs, batch-first.

The BlockStore (kvstore/store.py) owns the index, placement, leases and the
eviction order; a tier only holds payload bytes at locations it chooses and
never decides what to evict. Locations are opaque ints chosen by the tier.

Verbs and their promises:

- ``write(metas, sources) -> locs``: copy a batch of payloads in. When it
  returns, each payload is readable at its location; for a durable tier (NVMe)
  "returns" also means "acknowledged" under the tier's write policy
  (docs/nvme.md). Raises ``TierFull`` if the batch does not fit, ``TierFault``
  on I/O errors; either way no location of the batch stays allocated.
- ``read(locs, lengths, dests)``: fill caller buffers from a batch of
  locations (a disk tier coalesces adjacent records into large reads and
  verifies each record's checksum, raising ``CorruptBlock`` naming the bad
  locations; it never hands back bytes that failed their check).
- ``free(locs)``: the locations may be reused; their bytes are gone.
- ``used_bytes`` / ``capacity_bytes`` / ``stats()``: accounting.

Memory tiers (``MemoryTier``) add zero-copy verbs used by the data path:

- ``allocate(nbytes) -> loc | None``: reserve room for one payload (None when
  full: the store evicts and retries).
- ``view(loc, nbytes)``: a writable buffer over that room (a memoryview for
  host memory, a torch tensor for device memory).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# Tier ranks, matching kvstore.v1.Tier (0 means "absent").
HBM, DRAM, NVME = 1, 2, 3
TIER_NAMES = {HBM: "hbm", DRAM: "dram", NVME: "nvme"}


class TierFull(Exception):
    """The tier cannot take the batch even after the caller's eviction."""


class TierFault(Exception):
    """An I/O error (EIO, ENOSPC, ...): the tier is degraded."""


class CorruptBlock(Exception):
    """A stored record failed its checksum; ``locs`` lists the bad locations."""

    def __init__(self, message: str, locs: Sequence[int]):
        super().__init__(message)
        self.locs = list(locs)


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier needs to persist beside the bytes so the index can be rebuilt."""

    namespace: str
    hash: bytes
    parent: bytes
    codec: int
    dtype: str
    raw_length: int
    stored_length: int
    crc32c: int  # of the raw (decoded) bytes, per DESIGN 2.2


@dataclass
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    backend: str = ""
    degraded: bool = False
    fault: str = ""
    extra: dict[str, float] = field(default_factory=dict)


class Tier(ABC):
    rank: int  # HBM, DRAM or NVME
    name: str

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def write(self, metas: Sequence[BlockMeta], sources: Sequence[Any]) -> list[int]: ...

    @abstractmethod
    def read(self, locs: Sequence[int], lengths: Sequence[int], dests: Sequence[Any]) -> None: ...

    @abstractmethod
    def free(self, locs: Sequence[int]) -> None: ...

    def fits(self, nbytes: int) -> bool:
        """Whether a payload of nbytes could be placed once enough is evicted."""
        return nbytes <= self.capacity_bytes

    def freed_with(self, loc: int) -> tuple[int, int] | None:
        """The locations ``[lo, hi)`` whose space comes back only together with ``loc``'s (a log-structured
        tier's segment: its file goes once nothing in it is live), or None where each copy's space comes back
        on its own (memory tiers)."""
        return None

    def recover(self) -> Iterator[tuple[BlockMeta, int]]:
        """Blocks found on durable media at start (durable tiers only)."""
        return iter(())

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, self.used_bytes)

    def close(self) -> None:  # noqa: B027 - optional hook: tiers without resources need not override it
        """Flush and release resources."""


class MemoryTier(Tier):
    # memory in 4 KiB pages, into which an O_DIRECT read ran at half the speed of one into huge pages (a shared
    # arena on a tmpfs without huge pages): reads from NVMe land elsewhere first (kvstore/store/lower_reads.py)
    small_pages: bool = False

    @abstractmethod
    def allocate(self, nbytes: int) -> int | None: ...

    @abstractmethod
    def view(self, loc: int, nbytes: int) -> Any: ...

    def views(self, locs: Sequence[int], lengths: Sequence[int]) -> list[Any]:
        """``view`` of each (loc, nbytes) pair: a Get's blocks in one call."""
        return [self.view(loc, n) for loc, n in zip(locs, lengths)]
