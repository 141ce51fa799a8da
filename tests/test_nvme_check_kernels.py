"""The tier's compiled record checks (``check_kernels.check_piece``) against its Python ones, on real O_DIRECT files:
for any records read together, any corrupted byte and any wrong expectation, both fail the same records with the
same reasons and leave the same bytes in every buffer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import memops_jit
from kvstore.tiers.base import CorruptBlock
from kvstore.tiers.nvme import NvmeTier, reader
from kvstore.tiers.nvme.format import PAGE, crc32c, split_loc
from kvstore.tiers.nvme.io import aligned_buffer
from tests.test_nvme_tier import segment_files, write_blocks

pytestmark = pytest.mark.skipif(
    not memops_jit.AVAILABLE, reason="the compiled kernels need numba and a CPU with SSE4.2 and PCLMULQDQ"
)
SIZES = [4096, 65536, 1, 5000, 12288, 100_000, 131072, 8191, 0, 3 * PAGE + 5] * 3


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NvmeTier, list[int], list[bytes], Path]]:
    from kvstore.tiers.nvme import check_kernels

    check_kernels.warm_up()
    root = tmp_path_factory.mktemp("nvme")
    tier = NvmeTier(root, 256 << 20, segment_bytes=64 << 20, read_threads=1)  # pieces in order: the same first failure
    blocks = write_blocks(tier, SIZES, np.random.default_rng(3))
    yield tier, list(blocks), list(blocks.values()), segment_files(root)[0]
    tier.close()


def _read(tier: NvmeTier, locs: list[int], lengths: list[int], crcs: list[int], aligned: list[bool], compiled: bool):
    from kvstore.tiers.nvme import check_kernels

    saved = reader.compiled_checks
    reader.compiled_checks = (lambda: check_kernels) if compiled else (lambda: None)  # type: ignore[assignment]
    dests: list[object] = []
    for n, a in zip(lengths, aligned):
        d = aligned_buffer(n) if a else np.frombuffer(bytearray(n + 8), np.uint8)[8:]
        d[:] = 0xAA
        dests.append(d)
    try:
        tier.read(locs, lengths, dests, None, crcs)
        failure = None
    except CorruptBlock as err:
        failure = (sorted(err.locs), str(err))
    finally:
        reader.compiled_checks = saved  # type: ignore[assignment]
    return failure, [bytes(memoryview(d)) for d in dests]  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.integers(0, len(SIZES) - 1), min_size=1, max_size=12),
    aligned=st.lists(st.booleans(), min_size=12, max_size=12),
    flips=st.lists(st.tuples(st.integers(0, len(SIZES) - 1), st.integers(0, PAGE + 140_000)), max_size=3),
    wrong_crc=st.sets(st.integers(0, 11), max_size=2),
    short=st.sets(st.integers(0, 11), max_size=1),
)
def test_compiled_checks_fail_and_fill_exactly_as_the_python_ones(tier, picks, aligned, flips, wrong_crc, short):
    t, locs, payloads, segment = tier
    chosen = [locs[i] for i in picks]
    lengths = [len(payloads[i]) - (k in short and len(payloads[i]) > 0) for k, i in enumerate(picks)]
    crcs = [crc32c(payloads[i]) ^ (k in wrong_crc) for k, i in enumerate(picks)]
    fd = os.open(segment, os.O_RDWR)
    undo: list[tuple[int, bytes]] = []
    try:
        for i, at in flips:  # within the record: header page, payload or its zero pad
            offset = split_loc(locs[i])[1] + at % (PAGE + max(len(payloads[i]), 1))
            old = os.pread(fd, 1, offset)
            undo.append((offset, old))
            os.pwrite(fd, bytes([old[0] ^ 0x5A]), offset)
        expected = _read(t, chosen, lengths, crcs, aligned, compiled=False)
        assert _read(t, chosen, lengths, crcs, aligned, compiled=True) == expected
        if not flips and not wrong_crc and not short:
            assert expected[0] is None and expected[1] == [payloads[i] for i in picks]
    finally:
        for offset, old in reversed(undo):
            os.pwrite(fd, old, offset)
        os.close(fd)
