"""The write-combining buffer: whatever the mix of chunks, the file gets exactly their concatenation."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.tiers.nvme.faults import InstrumentedBackend
from kvstore.tiers.nvme.format import PAGE, align_up
from kvstore.tiers.nvme.io import PosixBackend, aligned_buffer
from kvstore.tiers.nvme.writer import DIRECT_MIN, WriteCombiner

# a record-like piece: (payload length, payload page aligned in memory?)
piece = st.tuples(st.integers(0, 40 * PAGE + 123), st.booleans())


def chunks_for(pieces: list[tuple[int, bool]], rng: np.random.Generator) -> tuple[list, bytes]:
    """Header page + payload + zero pad per piece, like the log lays records out."""
    chunks: list = []
    expect = bytearray()
    for n, aligned in pieces:
        header = np.frombuffer(rng.bytes(PAGE), np.uint8)
        if aligned:
            payload = aligned_buffer(n)
            payload[:] = np.frombuffer(rng.bytes(n), np.uint8)
        else:
            payload = np.frombuffer(b"\0" + rng.bytes(n), np.uint8)[1:]  # deliberately misaligned
        pad = align_up(n) - n
        chunks += [header, payload] + ([pad] if pad else [])
        expect += header.tobytes() + payload.tobytes() + bytes(pad)
    return chunks, bytes(expect)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(piece, min_size=1, max_size=12),
    io_pages=st.integers(1, 40),
    seed=st.integers(0, 99),
    start_page=st.integers(0, 3),
)
def test_any_chunk_mix_lands_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, pieces: list[tuple[int, bool]], io_pages: int, seed: int, start_page: int
) -> None:
    path = tmp_path_factory.mktemp("wc") / "f"
    backend = InstrumentedBackend(PosixBackend())
    fh = backend.create(str(path), 8 << 20)
    wc = WriteCombiner(backend, io_bytes=io_pages * PAGE, buffers=3)
    chunks, expect = chunks_for(pieces, np.random.default_rng(seed))
    try:
        assert wc.write(fh, start_page * PAGE, chunks) == len(expect)
        got = aligned_buffer(align_up(len(expect)))
        backend.pread(fh, got, start_page * PAGE)
        assert got[: len(expect)].tobytes() == expect
        if any(a and n >= DIRECT_MIN for n, a in pieces):
            assert wc.bytes_in_place > 0
    finally:
        wc.close()
        backend.close(fh)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(piece, min_size=1, max_size=12),
    io_pages=st.integers(1, 40),
    seed=st.integers(0, 99),
    header_len=st.integers(0, PAGE),
)
def test_records_as_header_bytes_and_payload_land_byte_exact(
    tmp_path_factory: pytest.TempPathFactory, pieces: list[tuple[int, bool]], io_pages: int, seed: int, header_len: int
) -> None:
    """The log's form: (header bytes, payload) per record; the combiner adds the zero fill and pad."""
    path = tmp_path_factory.mktemp("wc") / "f"
    backend = InstrumentedBackend(PosixBackend())
    fh = backend.create(str(path), 8 << 20)
    wc = WriteCombiner(backend, io_bytes=io_pages * PAGE, buffers=3)
    rng = np.random.default_rng(seed)
    chunks: list = []
    expect = bytearray()
    for n, aligned in pieces:
        header = rng.bytes(header_len)
        payload = aligned_buffer(n) if aligned else np.frombuffer(b"\0" + rng.bytes(n), np.uint8)[1:]
        if aligned:
            payload[:] = np.frombuffer(rng.bytes(n), np.uint8)
        chunks.append((header, payload))
        expect += header + bytes(PAGE - header_len) + payload.tobytes() + bytes(align_up(n) - n)
    try:
        assert wc.write(fh, 0, chunks) == len(expect)
        got = aligned_buffer(len(expect))
        backend.pread(fh, got, 0)
        assert got.tobytes() == bytes(expect)
    finally:
        wc.close()
        backend.close(fh)


def test_aligned_payloads_are_not_copied(tmp_path: Path) -> None:
    backend = InstrumentedBackend(PosixBackend())
    fh = backend.create(str(tmp_path / "f"), 8 << 20)
    wc = WriteCombiner(backend, io_bytes=2 << 20)
    chunks, expect = chunks_for([(DIRECT_MIN, True)] * 4 + [(DIRECT_MIN // 2, True)], np.random.default_rng(0))
    wc.write(fh, 0, chunks)
    assert wc.bytes_in_place == 4 * DIRECT_MIN  # the one under DIRECT_MIN is copied, like the headers
    assert wc.bytes_copied == 5 * PAGE + DIRECT_MIN // 2
    # I/Os start at 512 KiB and grow 4x up to io_bytes: record 1, records 2-3, the rest
    assert backend.pwrites == 3
    got = aligned_buffer(len(expect))
    backend.pread(fh, got, 0)
    assert got.tobytes() == expect
    wc.close()
    backend.close(fh)


def test_a_failed_io_is_raised_after_the_others_settle(tmp_path: Path) -> None:
    backend = InstrumentedBackend(PosixBackend())
    fh = backend.create(str(tmp_path / "f"), 8 << 20)
    wc = WriteCombiner(backend, io_bytes=64 << 10, buffers=3)
    chunks, _ = chunks_for([(100_000, False)] * 8, np.random.default_rng(1))
    backend.fail_writes_after(300 << 10)
    with pytest.raises(OSError) as e:
        wc.write(fh, 0, chunks)
    assert e.value.errno == 28
    backend.heal()
    assert wc.write(fh, 0, chunks) > 0  # the combiner is usable again
    wc.close()
    backend.close(fh)
    assert os.path.getsize(tmp_path / "f") == 8 << 20
