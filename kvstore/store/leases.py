"""What the store's verbs hand out and raise: ``PutTicket`` (a reserved top-tier slot for a Put), ``Lease`` (a
block held for reading: never freed, demoted away or compacted under the reader), ``NotFoundError``,
``DataLossError``, and ``lease_windows(leases)``: a Get's leases in runs of about ``GET_WINDOW_BYTES`` stored
bytes, materialized and sent one run at a time."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvstore.tiers.base import BlockMeta


class NotFoundError(KeyError):
    def __init__(self, index: int, key: bytes):
        super().__init__(f"block {index} ({key.hex()}) is not in the store")
        self.index, self.key = index, key


class DataLossError(Exception):
    """A stored copy failed its checksum; it was dropped and is never served."""


@dataclass(slots=True)
class PutTicket:
    ns: int
    meta: BlockMeta
    dtype: int
    loc: int
    buffer: Any


@dataclass(slots=True)
class Lease:
    entry: int
    hash: bytes
    codec: int
    dtype: str
    raw_length: int
    stored_length: int
    crc32c: int
    rank: int  # tier the bytes come from
    buffer: Any = None  # filled for memory tiers at acquire, by materialize() otherwise
    hold: tuple[Any, int] | None = None  # (tier, or None: the staging arena; loc) freed at release
    promote: int | None = None  # a top-tier slot holding the verified bytes read: becomes the copy at release
    promote_copy: bool = False  # the verified bytes are in ``buffer`` (a staging slot), copied to ``promote`` then


GET_WINDOW_BYTES = 64 << 20  # NVMe reads of a Get are materialized this much at a time


def lease_windows(leases: list[Lease | None], budget: int = GET_WINDOW_BYTES) -> Iterator[list[Lease | None]]:
    """Consecutive runs of leases of about `budget` stored bytes: a Get materializes and sends one at a time."""
    window: list[Lease | None] = []
    size = 0
    for lease in leases:
        window.append(lease)
        size += lease.stored_length if lease is not None else 0
        if size >= budget:
            yield window
            window, size = [], 0
    if window:
        yield window
