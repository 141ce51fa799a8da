"""``cma.write_table``: a batch of our blocks, given as an (address, length) table, written into another
process's memory row for row, and a write the kernel cuts short refused as such."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.lanes import cma
from kvstore.memops import addresses_of

pytestmark = pytest.mark.skipif(not cma.available(), reason="process_vm_writev is Linux-only")


@pytest.mark.parametrize("blocks", [1, 3, cma.IOV_BATCH + 5])  # past one call's iovecs: a second call
def test_each_row_lands_at_its_address(blocks: int) -> None:
    rng = np.random.default_rng(blocks)
    sizes = rng.integers(1, 5000, blocks)
    sources = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in sizes]
    dest = np.zeros(int(sizes.sum()) + blocks, dtype=np.uint8)
    at = len(dest) - np.cumsum(sizes + 1)  # the last block first in ``dest``, a byte between each and the next
    remote = (int(dest.ctypes.data) + at).astype(np.uint64)
    assert cma.write_table(os.getpid(), addresses_of(sources), remote) == int(sizes.sum())
    for src, a in zip(sources, at.tolist()):
        assert np.array_equal(dest[a : a + len(src)], src)
    assert not dest[at + sizes].any()  # the byte after each block untouched


def test_a_row_outside_the_process_fails_with_the_errno() -> None:
    src = np.ones(4096, dtype=np.uint8)
    with pytest.raises(cma.DirectReadError) as err:
        cma.write_table(os.getpid(), addresses_of([src]), np.array([8], dtype=np.uint64))
    assert err.value.errno and "wrote 0 of 4096 bytes of 1 blocks" in str(err.value)
