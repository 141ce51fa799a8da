"""Server side of the cuda_ipc lane: the shm lane's verbs over a region in device memory.

Grants, leases, tokens, validation and status codes are the shm lane's
(``ShmServerLane``); what differs is where the bytes are and who checks them:

- put (commit): every block of the commit is copied region -> arena slot on
  the lane's CUDA stream (device to device into an HBM slot, device to pinned
  host into a DRAM slot), one synchronisation for the batch, then the CRC32C
  of each landed block is computed (HBM slots on the GPU where cupy is
  installed, else through one pinned staging copy: ``devices.CrcStaging``)
  and recorded as the block's checksum. The client sends none: there is
  no transport between its copy and ours, and computing it on the client
  would cost a device -> host copy on the path this lane exists to avoid.
- get: each leased block is copied arena slot -> region on the stream (device
  to device from HBM; host to device from a DRAM or NVMe-promoted slot), and
  the copies are waited for once before the leases go and the descriptors
  are sent.

Copies per side: put 1 (client tensor -> region) + 1 (region -> slot);
get 1 (slot -> region) + 1 (region -> client tensor). Device-to-device copies
run at HBM bandwidth, so the second copy that buys isolation (no client maps
the arena) costs microseconds per MiB.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

from kvstore.devices import Copier, CrcStaging
from kvstore.lanes.base import LaneError
from kvstore.lanes.cuda_region import DeviceRegion
from kvstore.lanes.server.copyout import CopyOut
from kvstore.lanes.server.grants import Slot
from kvstore.lanes.server.shm import ShmServerLane
from kvstore.lanes.server.storeops import StoreOps
from kvstore.v1 import lanes_pb2 as lpb


class CudaIpcServerLane(ShmServerLane):
    kind = "cuda_ipc"
    crcs_at_copy = False  # a CRC of device memory would cost a pass on the GPU: the client checks host copies
    streams_cold = False  # NVMe blocks are read first, then copied with the rest (the copies are asynchronous)

    def __init__(self, region: DeviceRegion, ops: StoreOps, lease_seconds: float):
        super().__init__(region, ops, lease_seconds)
        self._calls = threading.local()  # a Copier per serving thread: one get or put at a time on it
        self._staging = CrcStaging()
        self._staging_lock = threading.Lock()

    @property
    def _copier(self) -> Copier:
        copier = getattr(self._calls, "copier", None)
        if copier is None:
            copier = self._calls.copier = Copier()
        return copier

    def _land(self, slots: Sequence[Slot], descriptors: Sequence[lpb.BlockDescriptor]) -> list[int]:
        if any(d.address or d.segment_addresses for d in descriptors):
            raise LaneError(grpc.StatusCode.PERMISSION_DENIED, "a cuda_ipc commit cannot name client memory")
        dests = []
        copier = self._copier
        for slot in slots:
            assert slot.item.ticket is not None
            dst = slot.item.ticket.buffer
            copier.copy(dst, self.region.view[slot.offset : slot.offset + slot.length])
            dests.append(dst)
        copier.settle()
        with self._staging_lock:
            return self._staging.crcs(dests)

    @staticmethod
    def _claimed_crc(d: lpb.BlockDescriptor, computed: int) -> int:
        return computed

    def _copy_out(self, copies: Sequence[CopyOut]) -> None:
        copier = self._copier  # issued from this thread, on its stream, and waited for once
        for c in copies:
            copier.copy(c.dst, c.src)
        copier.settle()

    def _settle(self) -> None:
        self._copier.settle()
