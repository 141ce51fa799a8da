"""One vLLM block across every layer of the KV cache: the bytes of one store block. Runs in the worker.

vLLM 0.32 has no cross-layer block layout on the CPU backend (``LBHNC`` only: each layer's cache is
``[num_blocks, kv_heads, block_size, 2 * head_size]``), so a store block is ``layers`` separate pieces of
``page_bytes`` each. vLLM allocates every layer in one backing buffer with a fixed distance between layers;
when it does, ``CacheBlocks`` views the whole cache as ``[num_blocks, layers, page_bytes]`` (strided) and
each block as one strided ``[layers, page_bytes]`` tensor, so a gather or scatter is one copy call per block.
Otherwise it falls back to one copy per layer per block.

Verbs and promises:

- ``CacheBlocks.from_caches(kv_caches)``: layers ordered by their index in the layer name (``...layers.7...``),
  so two engines of the same model order them alike; all layers must share shape, dtype and device.
- ``gather(block_ids, out)``: block ``block_ids[i]`` of every layer into ``out[i]`` (a flat
  ``[n, block_bytes]`` uint8 tensor: layer 0's page, then layer 1's, ...). One copy of each byte, one copy call
  per run of consecutive block ids (with the cross-layer view). ``out`` may sit on the host when the cache is on
  a device: the copy is then device to host, and it has landed when ``gather`` returns.
- ``scatter(block_ids, src)``: the reverse, ``src`` on the cache's device or in (pinned) host memory. From the
  host the copies are only issued on the current CUDA stream (``non_blocking``): work queued on that stream
  after it sees the blocks; a caller that reuses ``src`` waits for ``scatter``'s returned event first.
- ``zero(block_ids)``: blocks a failed load may have half-written, zeroed in every layer.
- ``segments(block_ids)``: each block as a ``Segments`` of its per-layer pages (host caches only; ``host``
  says which), so a Get writes the store's bytes straight into the KV cache and a Put reads them there:
  no gather or scatter copy at all.
- ``host_ranges()``: a host cache's memory as (address, bytes) ranges, for advice to the kernel (huge pages).
- ``new_staging(n, on_host)``: an ``[n, block_bytes]`` buffer for device caches (gather/scatter): on the cache's
  device, or ``on_host`` in pinned host memory (so a Get writes it over the host lanes and one DMA per run of
  blocks takes it to the device).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.client import SegmentRows, Segments

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _layer_key(item: tuple[int, str]) -> tuple[int, int]:
    position, name = item
    found = _LAYER_INDEX.search(name)
    return (int(found.group(1)) if found else position, position)


def order_layers(names: Sequence[str]) -> list[str]:
    return [name for _, name in sorted(enumerate(names), key=_layer_key)]


@dataclass
class CacheBlocks:
    layer_names: list[str]
    num_blocks: int
    page_bytes: int
    device: torch.device
    dtype: torch.dtype
    _cross: _CrossLayout | None  # every layer in one storage at a fixed distance: blocks as strided views
    _per_layer: list[torch.Tensor]  # [num_blocks, page_bytes] uint8 views, one per layer
    _rows: SegmentRows | None = None  # host caches: block b as the Segments of row b of every layer

    @property
    def layers(self) -> int:
        return len(self.layer_names)

    @property
    def block_bytes(self) -> int:
        return self.layers * self.page_bytes

    @property
    def cross_layer_view(self) -> bool:
        """True when each block is one strided tensor (one copy call per block), not one per layer."""
        return self._cross is not None

    @property
    def host(self) -> bool:
        """The cache is host memory: blocks move as ``segments``, with no staging copy."""
        return bool(self.device.type == "cpu")

    @classmethod
    def from_caches(cls, kv_caches: dict[str, torch.Tensor]) -> CacheBlocks:
        if not kv_caches:
            raise ValueError("no KV cache layers registered")
        names = order_layers(list(kv_caches))
        tensors = [kv_caches[n] for n in names]
        first = tensors[0]
        for name, t in zip(names, tensors):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {name}: {tuple(t.shape)} {t.dtype} differs from {tuple(first.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"layer {name}: its cache is not contiguous (layout {t.stride()})")
        num_blocks = int(first.shape[0])
        page = first[0].numel() * first.element_size()
        per_layer = [t.view(torch.uint8).reshape(num_blocks, page) for t in tensors]
        rows = SegmentRows(per_layer) if first.device.type == "cpu" else None
        cross = _CrossLayout.of(tensors, num_blocks, page)
        return cls(names, num_blocks, page, first.device, first.dtype, cross, per_layer, rows)

    def host_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of a host cache's memory, layers that touch merged (a cache in one allocation is one)."""
        if not self.host:
            return []
        spans = sorted((t.data_ptr(), t.numel()) for t in self._per_layer)
        merged = [list(spans[0])]
        for address, n in spans[1:]:
            last = merged[-1]
            if address <= last[0] + last[1]:
                last[1] = max(last[1], address + n - last[0])
            else:
                merged.append([address, n])
        return [(a, n) for a, n in merged]

    def segments(self, block_ids: Sequence[int]) -> list[Segments]:
        if self._rows is None:
            raise ValueError(f"a {self.device.type} cache has no host segments: use new_staging and gather/scatter")
        return [self._rows.block(b) for b in block_ids]

    def new_staging(self, n: int, on_host: bool = False) -> torch.Tensor:
        if on_host and self.device.type != "cpu":
            return torch.empty((n, self.block_bytes), dtype=torch.uint8, pin_memory=True)
        return torch.empty((n, self.block_bytes), dtype=torch.uint8, device=self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        self._check(block_ids, out)
        to_host = out.device.type == "cpu" and self.device.type != "cpu"
        for i, b, n in consecutive_runs(block_ids):
            rows = out[i : i + n].view(n, self.layers, self.page_bytes)
            if self._cross is not None:
                rows.copy_(self._cross.blocks(b, n, self.layers, self.page_bytes), non_blocking=to_host)
                continue
            for layer, cache in enumerate(self._per_layer):
                rows[:, layer].copy_(cache[b : b + n], non_blocking=to_host)
        if to_host:  # the caller reads ``out`` next (a Put): the copies must have landed
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> torch.cuda.Event | None:
        """Copies ``src``'s rows into the blocks; from the host onto a device, the event that marks their end on
        the current stream (``src`` must not be rewritten before it has passed), else None."""
        self._check(block_ids, src)
        from_host = src.device.type == "cpu" and self.device.type != "cpu"
        for i, b, n in consecutive_runs(block_ids):
            rows = src[i : i + n].view(n, self.layers, self.page_bytes)
            if self._cross is not None:
                self._cross.blocks(b, n, self.layers, self.page_bytes).copy_(rows, non_blocking=from_host)
                continue
            for i_block in range(n):
                for layer, cache in enumerate(self._per_layer):
                    cache[b + i_block].copy_(rows[i_block, layer], non_blocking=from_host)
        if not from_host:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def zero(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            for cache in self._per_layer:
                cache[b].zero_()

    def _check(self, block_ids: Sequence[int], buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.block_bytes:
            raise ValueError(f"buffer {tuple(buf.shape)} {buf.dtype} is not [n, {self.block_bytes}] uint8")
        if buf.shape[0] < len(block_ids):
            raise ValueError(f"buffer holds {buf.shape[0]} blocks, {len(block_ids)} asked")


def consecutive_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index, first block id, count)`` of each run of consecutive ids: one copy call each."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


@dataclass(frozen=True)
class _CrossLayout:
    """Every layer in one storage, ``step`` bytes apart: blocks ``b .. b+n`` of all layers are one strided view."""

    flat: torch.Tensor  # the whole storage as uint8
    offset: int  # of layer 0's block 0, in bytes
    step: int  # from one layer's block 0 to the next layer's

    @classmethod
    def of(cls, tensors: list[torch.Tensor], num_blocks: int, page: int) -> _CrossLayout | None:
        storage = tensors[0].untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
            return None
        size = tensors[0].element_size()
        offsets = [t.storage_offset() * size for t in tensors]
        step = offsets[1] - offsets[0] if len(offsets) > 1 else num_blocks * page
        if step < num_blocks * page and len(offsets) > 1:
            return None  # layers overlap: not LBHNC packing
        if any(o != offsets[0] + i * step for i, o in enumerate(offsets)):
            return None
        flat = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage)
        return cls(flat, offsets[0], step)

    def blocks(self, first: int, n: int, layers: int, page: int) -> torch.Tensor:
        """Blocks ``first .. first+n`` as an ``[n, layers, page]`` view of the cache itself."""
        return self.flat.as_strided((n, layers, page), (page, self.step, 1), self.offset + first * page)
