"""Payloads as bytes: the one place that turns bytes-like objects, numpy arrays and torch tensors into flat byte
views (no copy when contiguous) and names their dtype as the wire spells it.

- ``as_bytes_view(payload) -> (memoryview, dtype)``: a flat uint8 view and the payload's dtype name.
- ``wire_dtype(name) -> str``: the dtype name a block header carries for a numpy/torch dtype name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_WIRE_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "uint8": "uint8",
    "int8": "int8",
    "float8_e4m3fn": "float8_e4m3fn",
}


def as_bytes_view(payload: Any) -> tuple[memoryview, str]:
    """A flat byte view of a payload without copying when it is contiguous, and its dtype name."""
    module = type(payload).__module__
    if module.startswith("torch"):
        import torch

        tensor = payload.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        flat = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        return memoryview(flat), dtype
    if isinstance(payload, np.ndarray):
        arr = np.ascontiguousarray(payload)
        dtype = "bfloat16" if arr.dtype.name in ("bfloat16", "|V2") else arr.dtype.name
        return arr.reshape(-1).view(np.uint8).data, dtype
    view = memoryview(payload)
    return (view if view.format == "B" and view.ndim == 1 else view.cast("B")), "uint8"


def wire_dtype(name: str) -> str:
    return _WIRE_DTYPES.get(name, name)
