"""GPUDirect Storage reads: NVMe records straight into device memory through kvikio.

``read_into_device(records, dests) -> [(index, reason)]`` for records whose
file handles carry a kvikio ``CuFile`` (``KvikioBackend``) and whose
destinations are CUDA tensors:

1. every record's 4 KiB header page is read into one pinned host buffer and
   every payload straight into its destination tensor (``CuFile.pread`` with
   a device buffer: DMA from the drive into HBM under GDS; kvikio's compat
   mode bounces through its own host buffers, which the backend's name says).
   All reads are submitted before any is waited for, so the drive sees them
   together.
2. each header is checked (magic, version, header CRC, the stored length the
   index expects), and each payload's CRC32C is checked on the bytes as they
   landed in device memory (one batched device -> host copy; CRC32C runs on
   the CPU, ``kvstore.devices.CrcStaging``).

A record that fails is reported and its destination zeroed, never left
holding unverified bytes. The payload starts 4 KiB aligned in the file
(format.py), so the device read is aligned on the file side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.tiers.nvme.format import HEADER_BYTES, check_header


@dataclass(frozen=True)
class DeviceRead:
    native: Any  # the segment's kvikio CuFile
    offset: int  # of the record (its header page) in the segment file
    length: int  # stored length the index expects
    dest: Any  # CUDA tensor receiving the payload (at least ``length`` bytes)


def is_device_dest(dest: Any) -> bool:
    return hasattr(dest, "is_cuda") and bool(dest.is_cuda)


def read_into_device(reads: Sequence[DeviceRead]) -> list[tuple[int, str]]:
    import torch

    from kvstore.devices import CrcStaging

    headers = np.empty(len(reads) * HEADER_BYTES, dtype=np.uint8)
    flats = [r.dest.reshape(-1).view(torch.uint8)[: r.length] for r in reads]
    futures = []
    for i, (r, flat) in enumerate(zip(reads, flats)):
        futures.append(r.native.pread(headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], file_offset=r.offset))
        futures.append(r.native.pread(flat, file_offset=r.offset + HEADER_BYTES) if r.length else None)
    got = []
    failed: list[tuple[int, str]] = []
    for i in range(len(reads)):
        try:
            h = futures[2 * i].get()
            p = futures[2 * i + 1].get() if futures[2 * i + 1] is not None else 0
            got.append((h, p))
        except Exception as err:  # noqa: BLE001 - kvikio raises RuntimeError for I/O errors
            got.append((0, -1))
            failed.append((i, f"read failed: {err}"))
    expected: dict[int, int] = {}
    for i, (r, (h, p)) in enumerate(zip(reads, got)):
        if p < 0:
            continue
        fields = check_header(headers, i * HEADER_BYTES) if h == HEADER_BYTES else None
        if fields is None:
            failed.append((i, "no valid record header at this location"))
        elif fields[0] != r.length:
            failed.append((i, f"record holds {fields[0]} bytes, caller expects {r.length}"))
        elif p != r.length:
            failed.append((i, "record extends past the end of the segment file"))
        else:
            expected[i] = fields[1]
    if expected:
        order = sorted(expected)
        crcs = CrcStaging().crcs([flats[i] for i in order])
        failed += [(i, "payload fails its CRC32C") for i, crc in zip(order, crcs) if crc != expected[i]]
    for i, _ in failed:
        flats[i].zero_()
    return sorted(failed)


def read_split(tier: Any, locs: Sequence[int], lengths: Sequence[int], dests: Sequence[Any]) -> None:
    """``NvmeTier.read`` with a kvikio backend and some CUDA destinations: those by GDS, the rest as usual.

    Raises ``CorruptBlock`` naming every location that failed, from either path, like ``NvmeTier.read``.
    """
    from kvstore.tiers.base import CorruptBlock
    from kvstore.tiers.nvme.format import split_loc

    device = [i for i, d in enumerate(dests) if is_device_dest(d)]
    host = [i for i, d in enumerate(dests) if not is_device_dest(d)]
    bad: dict[int, str] = {}
    if host:
        try:
            tier.read([locs[i] for i in host], [lengths[i] for i in host], [dests[i] for i in host])
        except CorruptBlock as err:
            bad.update((loc, "failed verification") for loc in err.locs)
    resolved, pinned = tier._log.pin([locs[i] for i in device])
    try:
        reads, index = [], []
        for i, (loc, seg) in zip(device, resolved):
            if seg is None:
                bad[locs[i]] = "no such location (never written, or compacted away)"
                continue
            reads.append(DeviceRead(seg.fh.native, split_loc(loc)[1], lengths[i], dests[i]))
            index.append(i)
        for j, reason in read_into_device(reads):
            bad[locs[index[j]]] = reason
    finally:
        tier._log.unpin(pinned)
    tier._counts["gds_blocks_read"] = tier._counts.get("gds_blocks_read", 0) + len(device)
    if bad:
        first = next(iter(bad.items()))
        raise CorruptBlock(
            f"{len(bad)} of {len(locs)} nvme records failed verification (first: loc {first[0]:#x}: {first[1]})",
            list(bad),
        )
