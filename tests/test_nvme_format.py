"""The NVMe record format, CRC helper, locations and the per-segment record table."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme.format import (
    HEADER_BYTES,
    PAGE,
    check_header,
    crc32c,
    decode_header,
    encode_header,
    make_loc,
    record_bytes,
    split_loc,
)
from kvstore.tiers.nvme.segments import RecordTable


def meta(ns: str = "tenant/ns", parent: bytes = b"\x01" * 16, n: int = 1000) -> BlockMeta:
    return BlockMeta(ns, bytes(range(16)), parent, 2, "bfloat16", 2 * n, n, 0xDEADBEEF)


@pytest.mark.parametrize("parent", [b"", b"\x07" * 16])
@pytest.mark.parametrize("ns", ["", "a", "ünïcødé/namespace", "x" * 1024])
def test_header_round_trip(parent: bytes, ns: str) -> None:
    m = meta(ns, parent)
    raw = encode_header(m, seq=123456789, stored_crc=42)
    assert len(raw) <= HEADER_BYTES
    page = raw + bytes(PAGE - len(raw))
    h = decode_header(page)
    assert h is not None
    assert h.meta == m and h.seq == 123456789 and h.stored_crc == 42 and h.header_len == len(raw)
    assert h.record_bytes == record_bytes(m.stored_length)
    assert check_header(page) == (m.stored_length, 42)


def test_every_single_byte_flip_of_a_header_is_detected() -> None:
    raw = bytearray(encode_header(meta(), 7, 99))
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 0x40
        assert decode_header(bytes(flipped) + bytes(PAGE)) is None, f"flip at byte {i} not detected"
        assert check_header(bytes(flipped) + bytes(PAGE)) is None, f"flip at byte {i} not detected"


def test_zeros_and_garbage_are_not_headers() -> None:
    assert decode_header(bytes(PAGE)) is None
    assert decode_header(np.random.default_rng(0).integers(0, 256, PAGE, dtype=np.uint8)) is None
    assert decode_header(b"KVSR") is None


def test_invalid_metadata_is_refused() -> None:
    with pytest.raises(ValueError, match="namespace"):
        encode_header(meta("x" * 1025), 1, 1)
    with pytest.raises(ValueError, match="hash"):
        encode_header(BlockMeta("ns", b"short", b"", 0, "float16", 1, 1, 0), 1, 1)
    with pytest.raises(ValueError, match="parent"):
        encode_header(meta(parent=b"\x00" * 8), 1, 1)


def test_record_sizes_are_page_aligned() -> None:
    assert record_bytes(0) == PAGE
    assert record_bytes(1) == 2 * PAGE
    assert record_bytes(PAGE) == 2 * PAGE
    assert record_bytes(64 << 10) == (64 << 10) + PAGE


def test_locations_round_trip() -> None:
    for seg, off in [(1, 0), (7, 4096), (2**20, (1 << 40) - 4096)]:
        assert split_loc(make_loc(seg, off)) == (seg, off)


def test_crc32c_matches_the_reference_for_every_buffer_kind() -> None:
    data = np.random.default_rng(1).integers(0, 256, 100_003, dtype=np.uint8)
    want = google_crc32c.value(data.tobytes())
    for buf in (
        data.tobytes(),
        bytearray(data.tobytes()),
        memoryview(data.tobytes()),
        data,
        data.view(np.uint8).reshape(-1),
    ):
        assert crc32c(buf) == want
    assert crc32c(data[50_000:], crc32c(data[:50_000])) == want


def test_record_table_accounting() -> None:
    t = RecordTable(capacity=2)
    offs = [0, 8192, 4096 * 5, 4096 * 9]
    for off in offs:
        t.append(off, 8192 if off != 4096 * 5 else 4 * 4096)
    assert t.count == 4 and t.live_bytes == 3 * 8192 + 4 * 4096
    assert t.find(8192) == 1 and t.find(4096) == -1 and t.find(8193) == -1
    assert t.kill(8192) == 8192 and t.kill(8192) == 0 and t.kill(12345) == 0
    assert list(t.live()) == [(0, 8192), (4096 * 5, 4 * 4096), (4096 * 9, 8192)]
    assert t.dead_offsets().tolist() == [2]
    with pytest.raises(ValueError):
        t.append(4096, 4096)
