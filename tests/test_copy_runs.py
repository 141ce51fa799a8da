"""A shm Get's copies out of mapped memory planned in one batch (kvstore/lanes/client/outputs.py ``_copy_run``):
blocks into single buffers and into span tables (a vLLM block's pages), mixed in one run, clipped or not, against
each block copied alone and the CRC32C of its bytes; and ``clip_table`` against ``clip``."""

from __future__ import annotations

import numpy as np
import pytest
from crc32c import crc32c as reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import memops_jit
from kvstore.lanes.client import outputs
from kvstore.lanes.client.outputs import SpanCopy
from kvstore.lanes.segments import clip, clip_table

pytestmark = [
    pytest.mark.skipif(not memops_jit.AVAILABLE, reason="numba or SSE4.2/PCLMULQDQ missing"),
    pytest.mark.usefixtures("compiled_kernels"),
]

SOURCE = np.random.default_rng(3).integers(0, 256, size=1 << 20, dtype=np.uint8)


def _address(a: np.ndarray) -> int:
    return int(a.ctypes.data)


block_st = st.tuples(
    st.lists(st.integers(0, 3000), min_size=0, max_size=12),  # the destination's parts (0: an empty part)
    st.booleans(),  # a span table (a Segments' pages) or one buffer's span as a tuple
    st.integers(0, 3),  # bytes of the destination the block leaves unwritten (a clipped table)
    st.booleans(),  # checked
)


@settings(max_examples=150, deadline=None)
@given(blocks=st.lists(block_st, min_size=1, max_size=10), at=st.integers(0, 4096))
def test_a_run_copies_and_checks_each_block_as_copying_it_alone_does(blocks, at):
    copies, expected, places = [], [], []
    keep: list[np.ndarray] = []
    source = _address(SOURCE) + at
    for parts, as_table, short, check in blocks:
        parts = parts if as_table else [sum(parts)]
        buffers = [np.zeros(n, dtype=np.uint8) for n in parts]
        keep += buffers
        spans = tuple((_address(b), len(b)) for b in buffers if len(b))
        n = max(sum(parts) - short, 0)
        if as_table:
            table = np.array(spans, dtype=np.int64).reshape(-1, 2)
            dst: SpanCopy = SpanCopy(clip_table(table, n) if short else table, source)
        else:
            dst = SpanCopy(clip(spans, n), source)
        src = memoryview(SOURCE)[source - _address(SOURCE) : source - _address(SOURCE) + n]
        copies.append((dst, src, check))
        expected.append(reference(src) if check else None)
        places.append((buffers, bytes(src)))
        source += n + 7
    assert outputs._copy_run(copies) == expected
    for buffers, want in places:
        got = b"".join(bytes(b) for b in buffers)
        assert got[: len(want)] == want and not any(got[len(want) :])  # nothing past the block's bytes


@given(spans=st.lists(st.tuples(st.integers(1, 1 << 40), st.integers(0, 99)), max_size=20), n=st.integers(0, 3000))
def test_clip_table_keeps_what_clip_keeps(spans, n):
    table = np.array(spans, dtype=np.int64).reshape(-1, 2)
    assert [tuple(r) for r in clip_table(table, n).tolist()] == list(clip(tuple(spans), n))
