"""Sidecar files beside the segments: per-segment summaries and the free-list checkpoint.

Both are accelerators and bookkeeping, never the source of truth for bytes:
every record still carries its own header and CRCs, and reads verify them.

Segment summary ``seg-<id>.sum``, written when a segment is sealed (it is never
appended to afterwards), so recovery reads one small file instead of scanning
the segment. It is columnar, so loading it is a few numpy views::

    magic b"KVSS" | version u16 | reserved u16 | segment id u64 | end u64
    | count u32 | namespaces u32 | dtypes u32
    namespaces x ( length u16 | utf-8 )        dtypes x ( length u8 | ascii )
    columns, count entries each: offset in pages u32 | seq u64 | hash 16 B
    | parent 16 B | has parent u8 | codec u32 | dtype index u16 | namespace index u32
    | raw length u64 | stored length u64 | raw crc32c u32 | stored crc32c u32
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme.format import PAGE, Header, crc32c
from kvstore.tiers.nvme.segments import fsync_dir, summary_path

log = logging.getLogger("kvstore.nvme")

_SUM_HEAD = struct.Struct("<4sHHQQIII")
_U16 = struct.Struct("<H")
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


_KEY = "16B"  # 16 raw bytes each (numpy's S16 would drop trailing NULs)
_COLUMNS = (
    ("offset", "<u4"),
    ("seq", "<u8"),
    ("hash", _KEY),
    ("parent", _KEY),
    ("has_parent", "u1"),
    ("codec", "<u4"),
    ("dtype", "<u2"),
    ("namespace", "<u4"),
    ("raw_length", "<u8"),
    ("stored_length", "<u8"),
    ("raw_crc", "<u4"),
    ("stored_crc", "<u4"),
)


@dataclass
class SegmentRecords:
    """The records of one segment, as columns (ascending offsets)."""

    end: int
    offsets: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    metas: list[BlockMeta] = field(default_factory=list)


def write_summary(data_dir: Path, seg_id: int, end: int, records: list[tuple[int, Header]]) -> None:
    ns_idx: dict[str, int] = {}
    dt_idx: dict[str, int] = {}
    cols: dict[str, list[Any]] = {name: [] for name, _ in _COLUMNS}  # ints; 16-byte keys in the _KEY columns
    for off, h in records:
        m = h.meta
        for name, value in (
            ("offset", off // PAGE),
            ("seq", h.seq),
            ("hash", m.hash),
            ("parent", m.parent or bytes(16)),
            ("has_parent", 1 if m.parent else 0),
            ("codec", m.codec),
            ("dtype", dt_idx.setdefault(m.dtype, len(dt_idx))),
            ("namespace", ns_idx.setdefault(m.namespace, len(ns_idx))),
            ("raw_length", m.raw_length),
            ("stored_length", m.stored_length),
            ("raw_crc", m.crc32c & 0xFFFFFFFF),
            ("stored_crc", h.stored_crc),
        ):
            cols[name].append(value)
    parts = [_SUM_HEAD.pack(b"KVSS", VERSION, 0, seg_id, end, len(records), len(ns_idx), len(dt_idx))]
    for ns in ns_idx:
        raw = ns.encode("utf-8")
        parts += [_U16.pack(len(raw)), raw]
    for dt in dt_idx:
        raw = dt.encode("ascii")
        parts += [bytes([len(raw)]), raw]
    parts += [
        b"".join(cols[name]) if dtype == _KEY else np.asarray(cols[name], dtype=dtype).tobytes()
        for name, dtype in _COLUMNS
    ]
    body = b"".join(parts)
    _write_atomic(summary_path(data_dir, seg_id), body + _U32.pack(crc32c(body)), durable=False)


def read_summary(data_dir: Path, seg_id: int) -> SegmentRecords | None:
    """The records of a sealed segment from its summary, or None when missing or invalid."""
    path = summary_path(data_dir, seg_id)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    body = _checked(raw)
    if body is None or len(body) < _SUM_HEAD.size:
        log.warning("summary %s fails its checksum: scanning the segment instead", path)
        return None
    try:
        return _parse_summary(body, seg_id)
    except (ValueError, UnicodeDecodeError, struct.error, IndexError) as e:
        log.warning("summary %s is malformed (%s): scanning the segment instead", path, e)
        return None


def _parse_summary(body: bytes, seg_id: int) -> SegmentRecords:
    magic, version, _, sid, end, count, n_ns, n_dt = _SUM_HEAD.unpack_from(body, 0)
    if magic != b"KVSS" or version != VERSION or sid != seg_id:
        raise ValueError("wrong magic, version or segment id")
    pos = _SUM_HEAD.size
    namespaces, dtypes = [], []
    for _ in range(n_ns):
        (n,) = _U16.unpack_from(body, pos)
        namespaces.append(body[pos + 2 : pos + 2 + n].decode("utf-8"))
        pos += 2 + n
    for _ in range(n_dt):
        n = body[pos]
        dtypes.append(body[pos + 1 : pos + 1 + n].decode("ascii"))
        pos += 1 + n
    cols: dict[str, list[Any]] = {}
    for name, dtype in _COLUMNS:
        if dtype == _KEY:
            cols[name] = [body[p : p + 16] for p in range(pos, pos + 16 * count, 16)]
            pos += 16 * count
            continue
        arr = np.frombuffer(body, dtype=dtype, count=count, offset=pos)
        pos += arr.nbytes
        cols[name] = arr.tolist()
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} trailing bytes")
    metas = [
        BlockMeta(namespaces[ns], h, p if hp else b"", codec, dtypes[dt], raw_len, stored, rcrc)
        for ns, h, p, hp, codec, dt, raw_len, stored, rcrc in zip(
            cols["namespace"],
            cols["hash"],
            cols["parent"],
            cols["has_parent"],
            cols["codec"],
            cols["dtype"],
            cols["raw_length"],
            cols["stored_length"],
            cols["raw_crc"],
        )
    ]
    return SegmentRecords(end, [o * PAGE for o in cols["offset"]], cols["seq"], metas)


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
