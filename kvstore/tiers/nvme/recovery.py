"""Recovery: rebuild the tier's segment table and block list from the data directory.

``recover_log(data_dir, backend)`` runs once when the tier opens:

1. Every ``seg-*.log`` is opened. A segment with a valid summary is loaded from
   it (headers only, no payload read: payloads are verified on every read). A
   segment without one (it was active at a crash, or its summary is damaged) is
   scanned: records are read in large sequential reads and each must have a
   valid header CRC *and* payload CRC; the first record that fails (a torn
   tail, garbage, or the zeros of never-written space) ends the segment, and
   nothing after it is trusted. The scan then writes the missing summary.
2. Dead records named by the checkpoint are marked dead (frees since the last
   checkpoint are not persisted: those blocks come back, with valid bytes).
3. For each (namespace, hash) the record with the highest sequence number wins
   (a tie is a compaction copy of the same record: the newer location wins);
   the others are marked dead. Segments with nothing live are deleted.

All recovered segments are sealed: new writes always go to a fresh segment,
so no write ever lands behind a torn record.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme.format import (
    HEADER_BYTES,
    OFFSET_BITS,
    PAGE,
    Header,
    align_down,
    align_up,
    crc32c,
    decode_header,
)
from kvstore.tiers.nvme.io import FileHandle, IoBackend, aligned_buffer
from kvstore.tiers.nvme.segments import (
    RecordTable,
    Segment,
    SegmentState,
    list_segment_ids,
    segment_path,
    summary_path,
)
from kvstore.tiers.nvme.sidecar import RecordColumns, read_checkpoint, read_summary_columns, write_summary

log = logging.getLogger("kvstore.nvme")

SCAN_CHUNK = 8 << 20


@dataclass
class ScanResult:
    records: list[tuple[int, Header]]  # (offset, header) of every valid record, ascending
    end: int
    stop: str  # why the scan ended


class _Window:
    """A sliding aligned read window over one file, for sequential scans."""

    def __init__(self, backend: IoBackend, fh: FileHandle, size: int, chunk: int):
        self.backend, self.fh, self.size, self.chunk = backend, fh, size, chunk
        self.buf = aligned_buffer(chunk)
        self.start = self.len = 0

    def get(self, off: int, n: int) -> np.ndarray | None:
        if not (self.start <= off and off + n <= self.start + self.len):
            self.start = align_down(off)
            nread = min(self.chunk, align_up(self.size) - self.start)
            self.len = self.backend.pread(self.fh, self.buf[:nread], self.start)
            if off + n > self.start + self.len:
                return None
        rel = off - self.start
        return self.buf[rel : rel + n]


def scan_segment(backend: IoBackend, fh: FileHandle, size: int, chunk: int = SCAN_CHUNK) -> ScanResult:
    """Validate records from offset 0 until the first one that fails."""
    win = _Window(backend, fh, size, chunk)
    step = chunk - PAGE
    records: list[tuple[int, Header]] = []
    pos = 0

    def done(why: str) -> ScanResult:
        return ScanResult(records, pos, why)

    while True:
        if pos + PAGE > size:
            return done("end of file")
        page = win.get(pos, PAGE)
        if page is None:
            return done("short read")
        header = decode_header(page)
        if header is None:
            return done("end of written records" if not page.any() else f"invalid header at offset {pos}")
        nbytes = header.record_bytes
        if pos + nbytes > size:
            return done(f"record at offset {pos} runs past the end of the file")
        crc, p, left = 0, pos + PAGE, header.meta.stored_length
        while left:
            take = min(left, step)
            data = win.get(p, take)
            if data is None:
                return done(f"record at offset {pos} is cut short")
            crc = crc32c(data, crc)
            p += take
            left -= take
        if crc != header.stored_crc:
            return done(f"record at offset {pos} fails its payload CRC (torn write)")
        records.append((pos, header))
        pos += nbytes


@dataclass
class Winners:
    """The newest live record of every (namespace, hash), as columns: ``records`` (its fields, with
    ``offsets`` holding the tier location ``make_loc(segment, offset)``)."""

    records: RecordColumns

    def __len__(self) -> int:
        return len(self.records)

    def metas(self) -> list[tuple[BlockMeta, int]]:
        recs = self.records.to_records()
        return list(zip(recs.metas, recs.offsets))


@dataclass
class Recovered:
    segments: dict[int, Segment]
    columns: Winners | None
    next_seq: int
    next_segment_id: int
    summarized: int = 0  # segments loaded from their summary
    scanned: int = 0  # segments scanned record by record
    deleted: int = 0  # segments with nothing live, removed
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def winners(self) -> list[tuple[BlockMeta, int]]:
        """(meta, location) of every recovered block (built on demand: a Python object per block)."""
        return [] if self.columns is None else self.columns.metas()

    @property
    def count(self) -> int:
        return 0 if self.columns is None else len(self.columns)


def _cleanup(data_dir: Path, ids: list[int]) -> None:
    known = set(ids)
    for name in os.listdir(data_dir):
        if name.endswith(".tmp"):
            os.unlink(data_dir / name)
        elif name.startswith("seg-") and name.endswith(".sum") and int(name[4:-4]) not in known:
            os.unlink(data_dir / name)


def _load_segment(data_dir: Path, backend: IoBackend, seg_id: int, out: Recovered) -> tuple[Segment, RecordColumns]:
    path = segment_path(data_dir, seg_id)
    fh = backend.open(str(path))
    size = os.fstat(fh.fd).st_size
    recs = read_summary_columns(data_dir, seg_id)
    if recs is not None:
        out.summarized += 1
    else:
        res = scan_segment(backend, fh, size)
        out.scanned += 1
        out.notes.append(f"segment {seg_id}: scanned {len(res.records)} records, stopped: {res.stop}")
        if res.records:
            write_summary(data_dir, seg_id, res.end, res.records)
        recs = RecordColumns.of_records(
            res.end, [off for off, _ in res.records], [h.seq for _, h in res.records], [h.meta for _, h in res.records]
        )
    nbytes = HEADER_BYTES + ((recs.stored_length.astype(np.int64) + PAGE - 1) // PAGE) * PAGE
    table = RecordTable.bulk(recs.offsets, nbytes)
    seg = Segment(seg_id, path, fh, size, recs.end, SegmentState.SEALED, table, headers=None)
    return seg, recs


def recover_log(data_dir: Path, backend: IoBackend) -> Recovered:
    t0 = time.perf_counter()
    ids = list_segment_ids(data_dir)
    _cleanup(data_dir, ids)
    ckpt = read_checkpoint(data_dir)
    out = Recovered({}, None, 0, (max(ids) + 1) if ids else 1)
    if ckpt is not None:
        out.next_seq = ckpt.next_seq
        out.next_segment_id = max(out.next_segment_id, ckpt.next_segment_id)
    parts: list[tuple[int, np.ndarray, RecordColumns]] = []  # (segment, live record indices, columns)
    for seg_id in ids:
        seg, recs = _load_segment(data_dir, backend, seg_id, out)
        out.segments[seg_id] = seg
        if ckpt is not None and seg_id in ckpt.dead:
            seg.records.kill_pages(ckpt.dead[seg_id])
        if len(recs):
            out.next_seq = max(out.next_seq, int(recs.seqs.max()) + 1)
            parts.append((seg_id, np.nonzero(seg.records.live_flags()[: len(recs)])[0], recs))
    out.columns = _newest(parts, out.segments)
    for seg_id, seg in list(out.segments.items()):
        if seg.records.live_count == 0:
            backend.close(seg.fh)
            os.unlink(seg.path)
            summary_path(data_dir, seg_id).unlink(missing_ok=True)
            del out.segments[seg_id]
            out.deleted += 1
    out.seconds = time.perf_counter() - t0
    return out


_H1, _H2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)


def _newest_rows(keys: np.ndarray, seqs: np.ndarray, ns: np.ndarray) -> np.ndarray:
    """Rows of the newest record of each (namespace, key): the highest sequence number, a tie to the later
    row; in the order of each key's oldest record (its lowest sequence number, a tie to the earlier row).

    Keys are hashes, so nearly all are unique: one sort of a 64-bit digest of (namespace, key) finds the
    rows whose digest repeats, and only those go through the exact sort by (namespace, key, seq, row)."""
    n = len(seqs)
    with np.errstate(over="ignore"):
        digest = keys[:, 0] ^ (keys[:, 1] * _H1) ^ (ns.astype(np.uint64) * _H2)
    s = np.sort(digest)
    repeated = np.unique(s[1:][s[1:] == s[:-1]])
    if not len(repeated):
        return np.arange(n)
    at = np.minimum(np.searchsorted(repeated, digest), len(repeated) - 1)
    sub = np.nonzero(repeated[at] == digest)[0]  # every row whose digest some other row shares
    order = sub[np.lexsort((sub, seqs[sub], keys[sub, 1], keys[sub, 0], ns[sub]))]
    k, g = keys[order], ns[order]
    last = np.ones(len(order), dtype=np.bool_)  # the last row of each (namespace, key) run wins
    last[:-1] = (g[1:] != g[:-1]) | (k[1:, 0] != k[:-1, 0]) | (k[1:, 1] != k[:-1, 1])
    first = np.ones(len(order), dtype=np.bool_)
    first[1:] = last[:-1]
    rank = np.arange(n)  # where each winner goes: its own row, or the row of its key's oldest record
    rank[order[last]] = order[first]
    keep = np.ones(n, dtype=np.bool_)
    keep[order[~last]] = False
    rows = np.nonzero(keep)[0]
    return rows[np.argsort(rank[rows], kind="stable")]


def _newest(parts: list[tuple[int, np.ndarray, RecordColumns]], segments: dict[int, Segment]) -> Winners:
    """For each (namespace, hash) the live record with the highest sequence number (a tie is a compaction
    copy of the same record: the one met later, in segment then offset order, wins); the others are
    marked dead in their segments. One sort over all records instead of a dict entry per block."""
    namespaces: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("seg", "idx", "ns", "dtype")}
    picked: list[RecordColumns] = []
    for seg_id, live, recs in parts:
        ns_map = np.asarray([namespaces.setdefault(n, len(namespaces)) for n in recs.namespaces], dtype=np.uint32)
        dt_map = np.asarray([dtypes.setdefault(d, len(dtypes)) for d in recs.dtypes], dtype=np.uint16)
        cols["seg"].append(np.full(len(live), seg_id, dtype=np.int64))
        cols["idx"].append(live.astype(np.int64))
        cols["ns"].append(ns_map[recs.ns[live]] if len(ns_map) else np.zeros(len(live), np.uint32))
        cols["dtype"].append(dt_map[recs.dtype[live]] if len(dt_map) else np.zeros(len(live), np.uint16))
        picked.append(recs)
    if not parts:
        empty = RecordColumns.of_records(0, [], [], [])
        return Winners(empty)
    seg, idx, ns, dtype = (np.concatenate(cols[k]) for k in ("seg", "idx", "ns", "dtype"))

    def gather(name: str) -> np.ndarray:
        arrays = [getattr(r, name) for r in picked]
        return np.concatenate([c if len(live) == len(c) else c[live] for (_, live, _), c in zip(parts, arrays)])

    keys, seqs = gather("keys"), gather("seqs")
    win = _newest_rows(keys, seqs, ns)
    if len(win) < len(seqs):  # records of a key written again (or copied by compaction) lose to the newest
        lost = np.ones(len(seqs), dtype=np.bool_)
        lost[win] = False
        for s_id, i in zip(seg[lost].tolist(), idx[lost].tolist()):
            segments[s_id].records.kill_index(i)
    # every record won (the common case): they stay in log order, with no copy of the columns
    pick: np.ndarray | slice = slice(None) if len(win) == len(seqs) else win
    offsets = gather("offsets")[pick]
    locs = (seg[pick] << OFFSET_BITS) | offsets
    return Winners(
        RecordColumns(
            0,
            locs,
            seqs[pick],
            keys[pick],
            gather("parents")[pick],
            gather("has_parent")[pick],
            gather("codec")[pick],
            dtype[pick],
            ns[pick],
            gather("raw_length")[pick],
            gather("stored_length")[pick],
            gather("raw_crc")[pick],
            list(namespaces),
            list(dtypes),
        )
    )
