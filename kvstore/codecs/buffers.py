"""Zero-copy views of caller buffers as flat uint8 numpy arrays.

Payloads reach the codecs as bytes, bytearray, memoryview, numpy arrays or
torch tensors. ``as_u8`` turns any of them into a 1-D uint8 array through the
buffer protocol (a copy only when the source is not contiguous or lives on a
device); ``as_writable_u8`` does the same for a decode destination and refuses
anything it could not write through. torch is imported only when the caller
already handed us a tensor, so the store server never pays for it.
"""

from __future__ import annotations

import sys
from typing import Any, TypeGuard

import numpy as np

BufferLike = bytes | bytearray | memoryview | np.ndarray | Any
"""bytes-like, numpy array, or torch tensor (``Any`` because torch is optional)."""


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


def _is_tensor(data: object) -> TypeGuard[Any]:  # Any: a torch.Tensor, torch being optional
    tensor_type = _torch_tensor_type()
    return tensor_type is not None and isinstance(data, tensor_type)


def _tensor_u8(tensor: Any) -> np.ndarray:
    import torch

    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    arr: np.ndarray = flat.numpy()
    return arr


def as_u8(data: BufferLike) -> np.ndarray:
    """A read-only-intended 1-D uint8 view of ``data`` (zero-copy when contiguous)."""
    if isinstance(data, np.ndarray):
        arr = data if data.flags.c_contiguous else np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8)
    if _is_tensor(data):
        return _tensor_u8(data)
    view = memoryview(data)
    if not view.c_contiguous:
        return np.frombuffer(view.tobytes(), dtype=np.uint8)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


def as_writable_u8(out: BufferLike) -> np.ndarray:
    """A writable 1-D uint8 view sharing memory with ``out``.

    Raises ``TypeError`` for read-only, non-contiguous or device buffers; a
    device tensor is handled by the caller (``registry.decode_into``), which
    decodes into host memory and copies once.
    """
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise TypeError("decode destination must be a writable, C-contiguous array")
        return out.reshape(-1).view(np.uint8)
    if _is_tensor(out):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise TypeError("decode destination tensor must be contiguous host memory")
        return _tensor_u8(out)
    view = memoryview(out)
    if view.readonly or not view.c_contiguous:
        raise TypeError("decode destination must be a writable, contiguous buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


def is_device_tensor(out: object) -> TypeGuard[Any]:
    """True for a torch tensor that does not live in host memory."""
    return _is_tensor(out) and out.device.type != "cpu"


def nbytes_of(data: BufferLike) -> int:
    """Length in bytes without materialising a view."""
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    if _is_tensor(data):
        return int(data.numel() * data.element_size())
    return memoryview(data).nbytes
