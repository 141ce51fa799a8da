"""Payloads as bytes: the one place that turns bytes-like objects, numpy arrays and torch tensors into flat byte
views (no copy when contiguous) and names their dtype as the wire spells it.

- ``as_bytes_view(payload) -> (memoryview, dtype)``: a flat uint8 view and the payload's dtype name.
- ``wire_dtype(name) -> str``: the dtype name a block header carries for a numpy/torch dtype name.
- ``Segments(parts)``: one block given as several host buffers (a vLLM block is one slice per layer), where a
  Put payload or a Get ``out`` buffer goes: ``lengths``/``nbytes``, ``views`` (flat byte views, no copy),
  ``spans`` ((address, length) of each non-empty part, for the shm lane's cross-memory copies), ``crc32c()``
  (chained over the parts), ``chunks(size)`` (gRPC messages assembled from the parts), ``join()`` (one
  contiguous copy) and ``scatter(block)`` (the way back); ``SegmentsWriter`` fills one from chunks in order.
- ``SegmentRows(buffers).block(b)``: the Segments of block b where each buffer (a layer's KV tensor) holds one
  row per block: the cheap way to build many (offsets worked out once, not per part and call).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.memops import copy_into

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
        return arr.reshape(-1).view(np.uint8).data, _numpy_name(arr.dtype)
    view = memoryview(payload)
    return (view if view.format == "B" and view.ndim == 1 else view.cast("B")), "uint8"


_NUMPY_NAMES: dict[np.dtype[Any], str] = {}


def _numpy_name(dtype: np.dtype[Any]) -> str:
    """``dtype.name`` (ml_dtypes' bfloat16 as "bfloat16"), remembered: numpy works the name out in Python, 2-3 us
    each time, which a Get of 32 blocks paid twice per block."""
    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        name = dtype.name
        name = "bfloat16" if name in ("bfloat16", "|V2") else name
        if len(_NUMPY_NAMES) < 256:
            _NUMPY_NAMES[dtype] = name
    return name


def wire_dtype(name: str) -> str:
    return _WIRE_DTYPES.get(name, name)


class Segments:
    """One block given as several contiguous host buffers, in order (scatter-gather): the block's bytes are the
    concatenation of ``parts`` (bytes-like objects, numpy arrays, CPU torch tensors; CUDA tensors are accepted
    and go through host staging). A Put reads the parts where they are; a Get writes the block across them.

    The sizes, views and addresses are worked out once per object (cached), so build one per block and call.
    Immutable; equal only to itself.
    """

    __slots__ = ("__dict__",)

    def __init__(self, parts: Iterable[Any]):
        self.__dict__["parts"] = tuple(parts)

    @classmethod
    def _described(cls, make_parts: Callable[[], tuple[Any, ...]], **known: Any) -> Segments:
        """A block whose cached properties are given (``known``) and whose parts, flat byte views, are made on
        first use by ``make_parts``: a
        ``SegmentRows`` block, where a shm Get reads only its span table (30 memoryview slices a block were a
        third of a 62-block load of small pages)."""
        seg = cls.__new__(cls)
        seg.__dict__.update(known, _make_parts=make_parts)
        return seg

    @cached_property
    def parts(self) -> tuple[Any, ...]:
        parts: tuple[Any, ...] = self.__dict__["_make_parts"]()  # kept: two threads may ask at once
        return parts

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Segments is immutable: cannot set {name}")

    def __repr__(self) -> str:
        return f"Segments({len(self.lengths)} parts, {self.nbytes} bytes)"

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        """Bytes of each part."""
        return tuple(_nbytes(p) for p in self.parts)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the block: the sum of the parts'."""
        return sum(self.lengths)

    @cached_property
    def on_host(self) -> bool:
        """Every part is host memory (no CUDA tensor)."""
        return not any(_on_device(p) for p in self.parts)

    @cached_property
    def dtype(self) -> str:
        """The parts' dtype name when they share one, else ``uint8``."""
        kinds = {getattr(p, "dtype", None) for p in self.parts}  # torch or numpy dtypes, None for bytes-likes
        if len(kinds) != 1:
            return "uint8"
        return _dtype_of(self.parts[0]) if self.parts else "uint8"

    @cached_property
    def views(self) -> tuple[memoryview, ...]:
        """A flat byte view of each part, no copy (host parts only)."""
        if "_make_parts" in self.__dict__:  # made as flat byte views (``_described``)
            return self.parts
        return tuple(_flat_view(p) for p in self.parts)

    @cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(address, length) of each non-empty part, in order (host parts only): where the block is in memory."""
        if "span_table" in self.__dict__:  # known already (a SegmentRows block): its parts need not be made
            return tuple((address, n) for address, n in self.__dict__["span_table"].tolist())
        return tuple((_address(p), n) for p, n in zip(self.parts, self.lengths) if n)

    @cached_property
    def span_table(self) -> np.ndarray:
        """``spans`` as an int64 array of (address, length) rows, for copies planned with numpy."""
        return np.array(self.spans, dtype=np.int64).reshape(-1, 2)

    def head_views(self, n: int) -> list[memoryview]:
        """Non-empty flat views of the first ``n`` bytes (a Get's destination for an ``n``-byte block)."""
        out: list[memoryview] = []
        for view in self.views:
            if n <= 0:
                break
            if len(view):
                out.append(view[:n] if len(view) > n else view)
                n -= len(view)
        return out

    def crc32c(self, value: int = 0) -> int:
        """CRC32C of the concatenation (chained over the parts), continuing from ``value``."""
        for view in self.views:
            value = crc32c(view, value)
        return value

    def chunks(self, size: int) -> Iterator[bytes]:
        """The block in chunks of ``size`` bytes (the last may be shorter), each assembled from the parts."""
        return map(b"".join, self.chunk_parts(size))

    def chunk_parts(self, size: int) -> Iterator[list[memoryview]]:
        """The views of the parts that make each chunk of ``chunks``, not joined (no copy)."""
        pending: list[memoryview] = []
        filled = 0
        for part in self.views:
            offset = 0
            while offset < len(part):
                take = min(len(part) - offset, size - filled)
                pending.append(part[offset : offset + take])
                filled += take
                offset += take
                if filled == size:
                    yield pending
                    pending, filled = [], 0
        if pending:
            yield pending

    def join(self) -> memoryview:
        """The block as one new contiguous host buffer (one copy; for codecs and device lanes)."""
        out = memoryview(bytearray(self.nbytes))
        offset = 0
        for part, n in zip(self.parts, self.lengths):
            if n:
                copy_into(out[offset : offset + n], _flat_any(part))
            offset += n
        return out

    def scatter(self, block: Any) -> None:
        """Copy a contiguous block (bytes-like) across the parts: its first bytes into the first part, and so on."""
        src = as_bytes_view(block)[0]
        offset = 0
        for part, n in zip(self.parts, self.lengths):
            if offset >= len(src):
                return
            take = min(n, len(src) - offset)
            if take:
                copy_into(_flat_any(part)[:take], src[offset : offset + take])
            offset += take


class SegmentRows:
    """Blocks that are one row of each of several host buffers, as in vLLM's CPU KV cache (one tensor per layer,
    ``[num_blocks, ...]``: block b is row b of every layer): ``block(b)`` is that block's ``Segments``, built
    from each buffer's address and row size worked out once here, so a call costs no tensor operation per
    part (slicing 30 tensors per block, then asking each for its address, costs about 5 us a part here;
    this about 0.5 us). The buffers must be contiguous host memory, with the same number of rows; they are
    held for as long as this object or a Segments it made lives.
    """

    def __init__(self, buffers: Sequence[Any]):
        self.buffers = tuple(buffers)
        shapes = [getattr(b, "shape", None) for b in self.buffers]
        if not self.buffers or any(not shape for shape in shapes):
            raise ValueError("SegmentRows takes one or more tensors or arrays whose first dimension is the block")
        rows = {int(shape[0]) for shape in shapes if shape}
        if len(rows) != 1:
            raise ValueError(f"the buffers have different numbers of rows: {sorted(rows)}")
        self.rows = rows.pop()
        self._views = [_flat_view(b) for b in self.buffers]
        self._row_bytes = tuple(len(v) // self.rows if self.rows else 0 for v in self._views)
        self._addresses = [_address(b) if n else 0 for b, n in zip(self.buffers, self._row_bytes)]
        self._dtype = Segments(self.buffers).dtype
        self._nbytes = sum(self._row_bytes)
        used = [(a, n) for a, n in zip(self._addresses, self._row_bytes) if n]
        self._row0 = np.array(used, dtype=np.int64).reshape(-1, 2)  # row 0's spans; row b's: + b * _step
        self._step = np.array([(n, 0) for _, n in used], dtype=np.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return self.rows

    def block(self, row: int) -> Segments:
        """Row ``row`` of every buffer, as one block (no copy)."""
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} of {self.rows}")
        return Segments._described(  # the cached properties, from what was worked out once
            functools.partial(self._parts, row),
            lengths=self._row_bytes,
            nbytes=self._nbytes,
            on_host=True,
            dtype=self._dtype,
            span_table=self._row0 + row * self._step,
        )

    def _parts(self, row: int) -> tuple[memoryview, ...]:
        return tuple(v[row * n : (row + 1) * n] for v, n in zip(self._views, self._row_bytes))


class SegmentsWriter:
    """A block's bytes arriving in order, written across a Segments: ``writer[a:b] = chunk`` puts the next
    chunk (block offsets ``a:b``, which follow the previous chunk's) into the parts it falls on; ``crc32c()``
    is that of the first ``n`` bytes, chained over the parts."""

    def __init__(self, segments: Segments, n: int):
        if segments.nbytes < n:
            raise ValueError(f"output segments hold {segments.nbytes} bytes; block is {n}")
        self._views = segments.head_views(n)
        self._index, self._offset = 0, 0  # where the next chunk lands

    def __setitem__(self, key: slice, chunk: bytes | memoryview) -> None:
        data, at = memoryview(chunk), 0
        while at < len(data):
            view = self._views[self._index]
            take = min(len(view) - self._offset, len(data) - at)
            view[self._offset : self._offset + take] = data[at : at + take]
            at += take
            self._offset += take
            if self._offset == len(view):
                self._index, self._offset = self._index + 1, 0

    def crc32c(self) -> int:
        value = 0
        for view in self._views:
            value = crc32c(view, value)
        return value


def _is_tensor(part: Any) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: no tensors (a dict lookup, not an import)
    return torch is not None and isinstance(part, torch.Tensor)


def _on_device(part: Any) -> bool:
    return _is_tensor(part) and not part.is_cpu


def _nbytes(part: Any) -> int:
    if _is_tensor(part) or isinstance(part, np.ndarray):
        return int(part.nbytes)
    view = memoryview(part)
    return view.nbytes


def _dtype_of(part: Any) -> str:
    if _is_tensor(part):
        return wire_dtype(str(part.dtype).removeprefix("torch."))
    if isinstance(part, np.ndarray):
        return "bfloat16" if part.dtype.name in ("bfloat16", "|V2") else wire_dtype(part.dtype.name)
    return "uint8"


def _flat_view(part: Any) -> memoryview:
    """A flat uint8 view of a contiguous host part; ValueError for device tensors and non-contiguous parts
    (a contiguous copy would take writes a Get makes into it)."""
    if _is_tensor(part):
        if not part.is_cpu:
            raise ValueError("a CUDA tensor part has no host view")
        if not part.is_contiguous():
            raise ValueError("a tensor part must be contiguous")
        n = part.nbytes
        if not n:
            return memoryview(b"")
        # a ctypes array over the tensor's bytes (it keeps the tensor alive): about 1.5x cheaper here than
        # .numpy() and 3x cheaper than a uint8 reinterpretation, per part, and any dtype (bfloat16 too)
        array = (ctypes.c_char * n).from_address(part.data_ptr())
        array.part = part
        return memoryview(array).cast("B")
    if isinstance(part, np.ndarray):
        if not part.flags.c_contiguous:
            raise ValueError("an array part must be C-contiguous")
        return part.reshape(-1).view(np.uint8).data  # ndarray is typed as a Buffer only from Python 3.12
    view = memoryview(part)
    if not view.c_contiguous:
        raise ValueError("a buffer part must be contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _flat_any(part: Any) -> Any:
    """A flat uint8 view of a part: a torch tensor for device parts, a memoryview for host ones."""
    if _on_device(part):
        import torch

        return part.detach().reshape(-1).view(torch.uint8)
    return _flat_view(part)


def _address(part: Any) -> int:
    """Where a contiguous host part's bytes start."""
    if _is_tensor(part):
        if not part.is_cpu or not part.is_contiguous():
            raise ValueError("a tensor part must be a contiguous CPU tensor")
        return int(part.data_ptr())
    if isinstance(part, np.ndarray):
        if not part.flags.c_contiguous:
            raise ValueError("an array part must be C-contiguous")
        return int(part.ctypes.data)
    view = _flat_view(part)
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
