"""Device memory for the data path: CUDA tensors in the client API, batched device copies, CRCs of device bytes.

- ``is_device_tensor(x)`` / ``flat_bytes(t)``: a torch tensor off the CPU, and
  a contiguous tensor's bytes as a flat uint8 tensor (no copy).
- ``stage_out(out)``: host lanes move host bytes, so CUDA destinations of a Get
  that no cuda_ipc lane serves are filled through one pinned host staging
  buffer per call, reused across calls (device <- host copies issued together
  on a side stream, which alone is waited for at the end).
- ``Copier``: ``copy(dst, src)`` between host buffers and tensors of any
  device; copies that touch a CUDA device are issued together at ``settle()``,
  non-blocking on one side stream per device (truly asynchronous where the
  host side is pinned, as the DRAM arena is on a GPU machine), and waited for
  once. One synchronisation per batch, not per block (the HBM tier's
  demotions to DRAM, the cuda_ipc lane).
- ``CrcStaging.crcs(buffers)``: the CRC32C of each buffer; host buffers are
  read in place; device buffers are checksummed on the GPU where cupy is
  installed (``crc_gpu``), else through one pinned staging buffer with a single
  synchronisation and the CPU (about 11 ms per 128 MiB on one core of the H200
  host, the largest cost of a cuda_ipc Put; a thread pool measured slower
  there).

torch is imported only when a tensor is seen.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.checksum import crc32c
from kvstore.memops import copy_into, host_view


def is_device_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and getattr(getattr(x, "device", None), "type", "cpu") != "cpu"


def flat_bytes(tensor: Any) -> Any:
    """A contiguous torch tensor as a flat uint8 tensor (no copy)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("tensor payloads must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def stage_out(out: Sequence[Any] | None) -> tuple[Sequence[Any] | None, Callable[[], None]]:
    """Host buffers to receive into, and a finish() that copies them into the device tensors of `out`.

    One pinned buffer for the call (kept for the next: ``_pinned``), sliced per device tensor; finish() issues
    the copies on the devices' side streams (``Copier``) and waits for those streams only, not for the whole
    device as ``torch.cuda.synchronize()`` would (which also waited for an engine's forward pass)."""
    if out is None or not any(is_device_tensor(x) for x in out):
        return out, lambda: None
    sizes = []
    for x in out:
        if is_device_tensor(x) and not x.is_contiguous():
            raise ValueError("a tensor buffer must be contiguous")  # a reshape would copy: writes would be lost
        sizes.append(x.numel() * x.element_size() if is_device_tensor(x) else 0)
    host = _pinned.take(sum(sizes))
    staged: list[Any] = []
    pairs: list[tuple[Any, Any]] = []
    at = 0
    for x, n in zip(out, sizes):
        if is_device_tensor(x):
            view = host[at : at + n]
            at += n
            staged.append(view)
            pairs.append((x, view))
        else:
            staged.append(x)

    def finish() -> None:
        copier = Copier()
        for device_tensor, view in pairs:
            copier.copy(device_tensor, view)
        copier.settle()
        _pinned.give(host)

    return staged, finish


class _PinnedBuffers:
    """Pinned host buffers kept between calls (a pinned allocation costs far more than pageable memory): ``take(n)``
    one of at least n bytes, ``give`` it back once done; at most ``keep`` are kept, the largest; thread-safe."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> Any:
        import torch

        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= n:
                    return self._free.pop(i)
        return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def give(self, buf: Any) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: -b.numel())
            del self._free[self.keep :]


_pinned = _PinnedBuffers()


_streams: dict[Any, Any] = {}
_streams_lock = threading.Lock()


def _side_stream(device: Any) -> Any:
    import torch

    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


class Copier:
    """One batch of copies: ``copy`` each pair, then ``settle`` once. Use one per call (not thread-shared).

    Host-to-host pairs are copied at once; pairs that touch a device are queued and issued together at
    ``settle`` on a side stream (device-to-device ones as one ``torch._foreach_copy_`` where torch has it:
    one launch for the batch instead of one per block), then waited for.
    """

    def __init__(self) -> None:
        self._pending: dict[Any, list[tuple[Any, Any]]] = {}

    def copy(self, dst: Any, src: Any) -> None:
        on = dst if is_device_tensor(dst) else src if is_device_tensor(src) else None
        if on is None:
            copy_into(dst, src)
            return
        import torch

        d = dst if hasattr(dst, "copy_") else torch.frombuffer(host_view(dst), dtype=torch.uint8)
        s = src if hasattr(src, "copy_") else torch.frombuffer(host_view(src), dtype=torch.uint8)
        self._pending.setdefault(on.device, []).append((_flat_u8(d), _flat_u8(s)))

    def settle(self) -> None:
        if not self._pending:
            return
        import torch

        streams = []
        for device, pairs in self._pending.items():
            stream = _side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # see what the caller wrote before
            with torch.cuda.stream(stream):
                same = [(d, s) for d, s in pairs if d.device == s.device]
                if len(same) > 1 and hasattr(torch, "_foreach_copy_"):
                    torch._foreach_copy_([d for d, _ in same], [s for _, s in same], non_blocking=True)
                else:
                    same = []
                for d, s in pairs:
                    if not same or d.device != s.device:
                        d.copy_(s, non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()
        self._pending.clear()


def _flat_u8(t: Any) -> Any:
    import torch

    return t if t.dtype == torch.uint8 and t.dim() == 1 else t.reshape(-1).view(torch.uint8)


class CrcStaging:
    """A growing pinned host buffer for checking the CRC32C of device bytes (one per owner; not thread-shared)."""

    def __init__(self) -> None:
        self._buf: Any = None

    def crcs(self, buffers: Sequence[Any]) -> list[int]:
        out = [0] * len(buffers)
        device = [(i, b) for i, b in enumerate(buffers) if is_device_tensor(b)]
        for i, b in enumerate(buffers):
            if not is_device_tensor(b):
                out[i] = crc32c(host_view(b))
        if not device:
            return out
        from kvstore.crc_gpu import gpu_crc32c

        gpu = gpu_crc32c()
        if gpu is not None:  # checksummed where the bytes are: no device -> host copy
            for (i, _), crc in zip(device, gpu.crcs([b for _, b in device])):
                out[i] = crc
            return out
        import torch

        total = sum(b.numel() * b.element_size() for _, b in device)
        if self._buf is None or self._buf.numel() < total:
            self._buf = torch.empty(max(total, 1 << 20), dtype=torch.uint8, pin_memory=True)
        at, spans = 0, []
        for i, b in device:
            n = b.numel() * b.element_size()
            self._buf[at : at + n].copy_(b.reshape(-1).view(torch.uint8), non_blocking=True)
            spans.append((i, at, n))
            at += n
        torch.cuda.synchronize(device[0][1].device)
        view = memoryview(self._buf.numpy())
        for i, start, n in spans:
            out[i] = crc32c(view[start : start + n])
        return out
