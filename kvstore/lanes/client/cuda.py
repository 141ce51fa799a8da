"""Client side of the cuda_ipc lane: the shm lane's messages, device-to-device copies.

The region is the server's device memory, mapped once from its CUDA IPC
handle (``cuda_region.attach``). Payloads are torch tensors on that GPU (or
host buffers, which then cross PCIe once); copies are issued on one CUDA
stream and waited for once per commit (put) or per LaneGet message (get),
before the server is told the bytes are there or the grant is released.

Put sends no CRC32C: the server computes it on the bytes as they landed in
its arena slot. Get checks the CRC32C of blocks copied into host buffers; a
block copied into device memory is not checked here, since that would cost
the device-to-host copy this lane exists to avoid (the server checks every
NVMe read before a block is served, and HBM has ECC).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvstore.checksum import crc32c
from kvstore.devices import Copier, flat_bytes
from kvstore.devices import is_device_tensor as is_device
from kvstore.errors import corrupt_block, short_buffer
from kvstore.lanes.buffers import alloc_blocks
from kvstore.lanes.client.loans import Lender
from kvstore.lanes.client.shm import ShmClientLane
from kvstore.lanes.cuda_region import attach
from kvstore.memops import host_view
from kvstore.payload import as_bytes_view
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from kvstore.v1 import lanes_pb2_grpc as lpb_grpc


class CudaIpcClientLane(ShmClientLane):
    kind = "cuda_ipc"
    commit_bytes = 64 << 20  # device copies are quick: fewer, larger commits (each costs a message and a sync)

    def __init__(
        self,
        stub: lpb_grpc.KVStoreLanesStub,
        opened: lpb.OpenLaneResponse,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
    ):
        self.region = self._device_region = attach(opened.cuda_region, opened.shm_bytes)
        self.ref = lpb.LaneRef(lane_id=opened.lane_id, token=opened.token)
        self._stub, self._metadata, self._timeout = stub, metadata, timeout
        self._release: list[int] = []
        self._release_lock = threading.Lock()
        self._lender = Lender(None, self._give_back, budget=0)  # device memory is never lent
        self.direct = False  # device payloads: no process_vm_readv
        self._copier = Copier()

    @property
    def device(self) -> str:
        return self._device_region.device

    # -- put ---------------------------------------------------------------------------
    def write(self, slot: lpb.SlotGrant, payload: Any) -> int:
        self._copier.copy(self.region.view[slot.offset : slot.offset + slot.length], payload)
        return 0  # the server computes the CRC32C where the block lands

    def _place(self, slot: lpb.SlotGrant, payload: Any) -> None:
        self.write(slot, payload)

    def _settle(self) -> None:
        self._copier.settle()

    # -- get ---------------------------------------------------------------------------
    def _take_blocks(
        self,
        present: list[lpb.BlockDescriptor],
        start: int,
        out: Sequence[Any] | None,
        verify: bool,
        results: list[Any],
        loan: Any,
        crcs_at_copy: bool,
    ) -> None:
        import torch

        landed: list[tuple[int, lpb.BlockDescriptor, Any]] = []
        for d in present:
            i = start + d.index
            src = self.region.view[d.offset : d.offset + d.length]
            if out is not None:
                dst = _destination(out[i], i, d.length)
                results[i] = out[i]
            elif self.device == "cpu":  # the stand-in: host memory, as the shm lane returns
                dst = results[i] = alloc_blocks([d.length])[0]
            else:
                dst = results[i] = torch.empty(d.length, dtype=torch.uint8, device=self.device)
            self._copier.copy(dst, src)
            landed.append((i, d, dst))
        self._copier.settle()
        if verify:
            for i, d, dst in landed:
                if d.header.codec == pb.CODEC_NONE and not is_device(dst) and crc32c(host_view(dst)) != d.header.crc32c:
                    raise corrupt_block(i, d.hash)


def _destination(buf: Any, i: int, n: int) -> Any:
    """The first ``n`` bytes of an output buffer: a flat uint8 tensor for tensors, a memoryview otherwise."""
    if hasattr(buf, "copy_"):
        flat = flat_bytes(buf)
        size = flat.numel()
    else:
        flat = as_bytes_view(buf)[0]
        size = len(flat)
    if size < n:
        raise short_buffer(i, size, n)
    return flat[:n]
