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


@dataclass
class RecordColumns:
    """The records of one segment as numpy columns (no Python object per record): what recovery of
    millions of blocks works on. ``ns`` and ``dtype`` index ``namespaces`` and ``dtypes``; keys and
    parents are (n, 2) uint64 words of the 16-byte hashes."""

    end: int
    offsets: np.ndarray  # bytes, int64
    seqs: np.ndarray  # uint64
    keys: np.ndarray
    parents: np.ndarray
    has_parent: np.ndarray  # bool
    codec: np.ndarray
    dtype: np.ndarray
    ns: np.ndarray
    raw_length: np.ndarray
    stored_length: np.ndarray
    raw_crc: np.ndarray
    namespaces: list[str]
    dtypes: list[str]

    def __len__(self) -> int:
        return len(self.offsets)

    @classmethod
    def of_records(cls, end: int, offsets: list[int], seqs: list[int], metas: list[BlockMeta]) -> RecordColumns:
        namespaces = list(dict.fromkeys(m.namespace for m in metas))
        dtypes = list(dict.fromkeys(m.dtype for m in metas))
        ns_idx, dt_idx = {n: i for i, n in enumerate(namespaces)}, {d: i for i, d in enumerate(dtypes)}
        n = len(metas)

        def words(keys: list[bytes]) -> np.ndarray:
            return np.frombuffer(b"".join(keys), dtype="<u8").reshape(n, 2).copy() if n else np.zeros((0, 2), "<u8")

        return cls(
            end,
            np.asarray(offsets, dtype=np.int64),
            np.asarray(seqs, dtype=np.uint64),
            words([m.hash for m in metas]),
            words([m.parent or bytes(16) for m in metas]),
            np.asarray([bool(m.parent) for m in metas], dtype=np.bool_),
            np.asarray([m.codec for m in metas], dtype=np.uint32),
            np.asarray([dt_idx[m.dtype] for m in metas], dtype=np.uint16),
            np.asarray([ns_idx[m.namespace] for m in metas], dtype=np.uint32),
            np.asarray([m.raw_length for m in metas], dtype=np.uint64),
            np.asarray([m.stored_length for m in metas], dtype=np.uint64),
            np.asarray([m.crc32c & 0xFFFFFFFF for m in metas], dtype=np.uint32),
            namespaces,
            dtypes,
        )

    def to_records(self) -> SegmentRecords:
        keys = self.keys.astype("<u8").tobytes()
        parents = self.parents.astype("<u8").tobytes()
        metas = [
            BlockMeta(
                self.namespaces[ns],
                keys[16 * i : 16 * i + 16],
                parents[16 * i : 16 * i + 16] if hp else b"",
                codec,
                self.dtypes[dt],
                raw_len,
                stored,
                rcrc,
            )
            for i, (ns, hp, codec, dt, raw_len, stored, rcrc) in enumerate(
                zip(
                    self.ns.tolist(),
                    self.has_parent.tolist(),
                    self.codec.tolist(),
                    self.dtype.tolist(),
                    self.raw_length.tolist(),
                    self.stored_length.tolist(),
                    self.raw_crc.tolist(),
                )
            )
        ]
        return SegmentRecords(self.end, self.offsets.tolist(), self.seqs.tolist(), metas)


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
    cols = read_summary_columns(data_dir, seg_id)
    return None if cols is None else cols.to_records()


def read_summary_columns(data_dir: Path, seg_id: int) -> RecordColumns | None:
    """``read_summary`` as numpy columns (a few views of the file's bytes), or None when missing or invalid."""
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


def _parse_summary(body: bytes, seg_id: int) -> RecordColumns:
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
    cols: dict[str, np.ndarray] = {}
    for name, dtype in _COLUMNS:
        if dtype == _KEY:
            cols[name] = np.frombuffer(body, dtype="<u8", count=2 * count, offset=pos).reshape(count, 2)
            pos += 16 * count
            continue
        arr = np.frombuffer(body, dtype=dtype, count=count, offset=pos)
        pos += arr.nbytes
        cols[name] = arr
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} trailing bytes")
    if count and (int(cols["namespace"].max()) >= n_ns or int(cols["dtype"].max()) >= n_dt):
        raise IndexError("a record names a namespace or dtype the summary does not list")
    return RecordColumns(
        end,
        cols["offset"].astype(np.int64) * PAGE,
        cols["seq"],
        cols["hash"],
        cols["parent"],
        cols["has_parent"] != 0,
        cols["codec"],
        cols["dtype"],
        cols["namespace"],
        cols["raw_length"],
        cols["stored_length"],
        cols["raw_crc"],
        namespaces,
        dtypes,
    )


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
