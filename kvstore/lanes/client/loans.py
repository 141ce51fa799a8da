"""Get results lent straight out of a shm lane's region: no copy on the client, returned when dropped.

A Get without ``out`` buffers would copy every block out of the region into
fresh memory, which costs a copy plus the page faults (and the kernel's zeroing)
of that memory. Instead the lane lends the caller read access to the bytes
where the server put them:

- ``open(grant_id) -> Loan``: one loan per get grant; ``loan.view(offset,
  length)`` is a writable memoryview of the region (a slice of a numpy array
  private to the loan).
- When the caller has dropped every view of a loan, the loan's array is
  collected and ``on_return(grant_id)`` runs: the grant is released with the
  lane's next request and the server may reuse those ranges. Until then the
  server never writes there (get grants have no lease; they end on release or
  when the lane closes, and a closed lane's pages stay mapped as long as a
  view holds them).
- ``can_lend(nbytes)``: at most ``budget`` bytes (half the region) are lent at
  a time, so a caller that keeps many results never starves later Gets of
  region space: past the budget, blocks are copied out as before.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np

from kvstore.lanes.shm_region import ShmRegion


class Loan:
    def __init__(self, lender: Lender, grant_id: int):
        self.grant_id = grant_id
        self.nbytes = 0
        self._lender = lender
        region = lender.region
        assert region is not None  # a lender without a region has no budget: it never lends
        self._array: np.ndarray | None = np.frombuffer(region.mapping, dtype=np.uint8)
        weakref.finalize(self._array, lender._returned, self)

    def view(self, offset: int, length: int) -> memoryview:
        assert self._array is not None
        self._lender._add(self, length)
        return self._array[offset : offset + length].data

    def close(self) -> None:
        """The loan takes no more blocks; it ends when the views it gave out are gone."""
        self._array = None


class Lender:
    def __init__(self, region: ShmRegion | None, on_return: Callable[[int], None], budget: int):
        self.region, self.budget = region, budget
        self._on_return = on_return
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def can_lend(self, nbytes: int) -> bool:
        with self._lock:
            return self._held + nbytes <= self.budget

    def open(self, grant_id: int) -> Loan:
        return Loan(self, grant_id)

    def _add(self, loan: Loan, nbytes: int) -> None:
        with self._lock:
            loan.nbytes += nbytes
            self._held += nbytes

    def _returned(self, loan: Loan) -> None:
        with self._lock:
            self._held -= loan.nbytes
        self._on_return(loan.grant_id)
