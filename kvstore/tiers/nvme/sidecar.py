"""Sidecar files beside the segments: per-segment summaries and the free-list checkpoint.

Both are accelerators and bookkeeping, never the source of truth for bytes:
every record still carries its own header and CRCs, and reads verify them.

Segment summary ``seg-<id>.sum``, written when a segment is sealed (it is never
appended to afterwards), so recovery reads one small file instead of scanning
the segment::

    magic b"KVSS" | version u16 | reserved u16 | segment id u64 | end u64 | count u32
    count x ( offset in pages u32 | header length u16 | header bytes (as on disk) )
    crc32c u32 of everything before it

Checkpoint ``checkpoint``, written on close, after compaction and on demand:
the dead records of every segment (frees are in memory until then), plus the
next sequence number and segment id::

    magic b"KVSC" | version u16 | reserved u16 | next seq u64 | next segment id u64 | nsegs u32
    nsegs x ( segment id u64 | ndead u32 | ndead x offset in pages u32 )
    crc32c u32

A file that fails its CRC is ignored (a summary then falls back to a scan of
its segment). Files are written to ``*.tmp`` and renamed into place.
"""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.tiers.nvme.format import PAGE, Header, crc32c, decode_header
from kvstore.tiers.nvme.segments import fsync_dir, summary_path

log = logging.getLogger("kvstore.nvme")

_SUM_HEAD = struct.Struct("<4sHHQQI")
_SUM_ENTRY = struct.Struct("<IH")
_CKPT_HEAD = struct.Struct("<4sHHQQI")
_CKPT_SEG = struct.Struct("<QI")
_U32 = struct.Struct("<I")
VERSION = 1


def _write_atomic(path: Path, data: bytes, durable: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fdatasync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def _checked(data: bytes) -> bytes | None:
    if len(data) < 4 or crc32c(data[:-4]) != _U32.unpack_from(data, len(data) - 4)[0]:
        return None
    return data[:-4]


def write_summary(data_dir: Path, seg_id: int, end: int, headers: list[tuple[int, bytes]]) -> None:
    parts = [_SUM_HEAD.pack(b"KVSS", VERSION, 0, seg_id, end, len(headers))]
    for offset, header in headers:
        parts.append(_SUM_ENTRY.pack(offset // PAGE, len(header)))
        parts.append(header)
    body = b"".join(parts)
    _write_atomic(summary_path(data_dir, seg_id), body + _U32.pack(crc32c(body)), durable=False)


@dataclass(frozen=True, slots=True)
class Summary:
    end: int
    records: list[tuple[int, Header]]  # (offset, header), ascending


def read_summary(data_dir: Path, seg_id: int) -> Summary | None:
    """The summary of a sealed segment, or None when missing or invalid."""
    path = summary_path(data_dir, seg_id)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    body = _checked(raw)
    if body is None or len(body) < _SUM_HEAD.size:
        log.warning("summary %s fails its checksum: scanning the segment instead", path)
        return None
    magic, version, _, sid, end, count = _SUM_HEAD.unpack_from(body, 0)
    if magic != b"KVSS" or version != VERSION or sid != seg_id:
        log.warning("summary %s has a wrong magic, version or segment id: scanning instead", path)
        return None
    pos, records = _SUM_HEAD.size, []
    for _ in range(count):
        page, hlen = _SUM_ENTRY.unpack_from(body, pos)
        pos += _SUM_ENTRY.size
        header = decode_header(body[pos:pos + hlen])
        pos += hlen
        if header is None:
            log.warning("summary %s holds an invalid header: scanning instead", path)
            return None
        records.append((page * PAGE, header))
    return Summary(end, records)


@dataclass
class Checkpoint:
    next_seq: int
    next_segment_id: int
    dead: dict[int, np.ndarray]  # segment id -> dead record offsets, in pages


def write_checkpoint(data_dir: Path, ckpt: Checkpoint) -> None:
    parts = [_CKPT_HEAD.pack(b"KVSC", VERSION, 0, ckpt.next_seq, ckpt.next_segment_id, len(ckpt.dead))]
    for seg_id, pages in sorted(ckpt.dead.items()):
        arr = np.asarray(pages, dtype="<u4")
        parts.append(_CKPT_SEG.pack(seg_id, len(arr)))
        parts.append(arr.tobytes())
    body = b"".join(parts)
    _write_atomic(data_dir / "checkpoint", body + _U32.pack(crc32c(body)), durable=True)


def read_checkpoint(data_dir: Path) -> Checkpoint | None:
    try:
        raw = (data_dir / "checkpoint").read_bytes()
    except FileNotFoundError:
        return None
    body = _checked(raw)
    if body is None or len(body) < _CKPT_HEAD.size:
        log.warning("checkpoint in %s fails its checksum: ignored (freed blocks may reappear)", data_dir)
        return None
    magic, version, _, next_seq, next_seg, nsegs = _CKPT_HEAD.unpack_from(body, 0)
    if magic != b"KVSC" or version != VERSION:
        log.warning("checkpoint in %s has a wrong magic or version: ignored", data_dir)
        return None
    pos, dead = _CKPT_HEAD.size, {}
    for _ in range(nsegs):
        seg_id, n = _CKPT_SEG.unpack_from(body, pos)
        pos += _CKPT_SEG.size
        dead[seg_id] = np.frombuffer(body, dtype="<u4", count=n, offset=pos).astype(np.uint32)
        pos += 4 * n
    return Checkpoint(next_seq, next_seg, dead)
