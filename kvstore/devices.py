"""Device-aware payloads for the client: torch CUDA tensors in, torch CUDA tensors out.

Host lanes (gRPC, shm, tcp) move host bytes, so a CUDA destination is filled
through one pinned host staging buffer per call (device <- host copies are
issued asynchronously and synchronized once at the end). torch is imported
only when a tensor is seen; the CUDA IPC lane (HBM to HBM, no host hop) plugs
in below the client (kvstore/lanes/base.py).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence


def is_device_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and getattr(getattr(x, "device", None), "type", "cpu") != "cpu"


def stage_out(out: Sequence[Any] | None) -> tuple[Sequence[Any] | None, Callable[[], None]]:
    """Host buffers to receive into, and a finish() that copies them into the device tensors of `out`."""
    if out is None or not any(is_device_tensor(x) for x in out):
        return out, lambda: None
    import torch

    staged: list[Any] = []
    pairs: list[tuple[Any, Any]] = []
    for x in out:
        if is_device_tensor(x):
            host = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            staged.append(host)
            pairs.append((x, host))
        else:
            staged.append(x)

    def finish() -> None:
        for dev, host in pairs:
            dev.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return staged, finish
