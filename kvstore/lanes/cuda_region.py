"""Regions of the cuda_ipc lane: device memory the server allocates per lane and exports by CUDA IPC.

``DeviceRegion.create(device, size, shm_dir)`` (server): one torch allocation
of ``size`` bytes on ``device`` (a plain cudaMalloc through torch's allocator,
never managed memory), exported with torch's CUDA IPC: the
``cudaIpcMemHandle`` of the allocation holding it plus torch's cross-process
reference counter, so the memory stays valid while the client maps it even if
the server drops its tensor first. ``device="cpu"`` is the stand-in used where
no GPU exists: the region is a shm lane region file, wrapped as a torch tensor,
so every line of the lane above the handle exchange runs in tests here.

``attach(message, size) -> DeviceRegion`` (client): opens the handle on this
process's index of the same GPU (matched by uuid; CUDA_VISIBLE_DEVICES may
number it differently here) and returns a flat uint8 tensor over the region.
CUDA refuses to open a handle in the process that made it, so the server
never offers this lane to its own process.

What isolation means here: the region holds only this lane's blocks in
flight, never the arena (which holds every tenant's blocks). The client can
write its region at any time, so the server computes each put block's CRC32C
on the bytes after they landed in the arena slot.

Only ``_export_cuda``/``_import_cuda`` touch CUDA-only calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.lanes.shm_region import RegionError, ShmRegion
from kvstore.lanes.shm_region import attach as attach_shm
from kvstore.v1 import lanes_pb2 as lpb


@dataclass
class DeviceRegion:
    size: int
    view: Any  # flat uint8 torch tensor over the whole region
    message: lpb.CudaIpcRegion
    device: str
    _host: ShmRegion | None = field(default=None, repr=False)
    small_pages = False  # NVMe reads never land in it directly (it is not host memory, or only a stand-in)

    @classmethod
    def create(cls, device: str, size: int, shm_dir: str | None = None) -> DeviceRegion:
        import torch

        if device == "cpu":
            if shm_dir is None:
                raise RegionError(0, "the cpu stand-in of the cuda_ipc lane needs a shm directory")
            host = ShmRegion.create(shm_dir, size)
            view = torch.frombuffer(host.mapping, dtype=torch.uint8)
            return cls(size, view, lpb.CudaIpcRegion(host_path=host.path), "cpu", host)
        try:
            view = torch.empty(size, dtype=torch.uint8, device=device)
        except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
            raise RegionError(12, f"cannot allocate a {size}-byte cuda_ipc region on {device}: {err}") from None
        return cls(size, view, _export_cuda(view), str(view.device))

    def unlink(self) -> None:
        if self._host is not None:
            self._host.unlink()

    def close(self) -> None:
        """Drop this side's reference; torch frees device memory once no process maps it."""
        self.view = None
        if self._host is not None:
            self._host.close()


def attach(message: lpb.CudaIpcRegion, size: int) -> DeviceRegion:
    import torch

    if message.host_path:
        host = attach_shm(message.host_path, size)
        return DeviceRegion(size, torch.frombuffer(host.mapping, dtype=torch.uint8), message, "cpu", host)
    if not torch.cuda.is_available():
        raise RegionError(19, "a cuda_ipc lane needs a CUDA device in this process")
    view = _import_cuda(message)
    if view.numel() != size:
        raise RegionError(22, f"cuda_ipc region maps {view.numel()} bytes; the server announced {size}")
    return DeviceRegion(size, view, message, str(view.device))


def _export_cuda(tensor: Any) -> lpb.CudaIpcRegion:
    import torch

    storage = tensor.untyped_storage()
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    index = int(device) if not hasattr(device, "index") else int(device.index or 0)
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return lpb.CudaIpcRegion(
        device_uuid=uuid,
        device_index=index,
        handle=bytes(handle),
        storage_bytes=storage_bytes,
        storage_offset=storage_offset,
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=ref_offset,
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync),
    )


def _local_index(uuid: str, fallback: int) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if uuid and str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) == uuid:
            return i
    if uuid:
        raise RegionError(19, f"the lane's GPU {uuid} is not visible to this process")
    return fallback


def _import_cuda(m: lpb.CudaIpcRegion) -> Any:
    import torch

    index = _local_index(m.device_uuid, m.device_index)
    torch.cuda._lazy_init()
    with torch.cuda.device(index):
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                index,
                m.handle,
                m.storage_bytes,
                m.storage_offset,
                m.ref_counter_handle,
                m.ref_counter_offset,
                m.event_handle or None,
                m.event_sync_required,
            )
        except RuntimeError as err:
            raise RegionError(1, f"cannot open the cuda_ipc handle on cuda:{index}: {err}") from None
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (m.storage_bytes,))
