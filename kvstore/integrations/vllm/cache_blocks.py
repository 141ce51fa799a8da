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
  ``[n, block_bytes]`` uint8 tensor: layer 0's page, then layer 1's, ...). One copy of each byte.
- ``scatter(block_ids, src)``: the reverse. One copy of each byte.
- ``zero(block_ids)``: blocks a failed load may have half-written, zeroed in every layer.
- ``segments(block_ids)``: each block as a ``Segments`` of its per-layer pages (host caches only; ``host``
  says which), so a Get writes the store's bytes straight into the KV cache and a Put reads them there:
  no gather or scatter copy at all.
- ``new_staging(n)``: an ``[n, block_bytes]`` buffer on the cache's device, for device caches (gather/scatter).
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
    _per_block: tuple[torch.Tensor, ...] | None  # strided [layers, page_bytes] views, one per block
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
        return self._per_block is not None

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
        cross = _cross_view(tensors, num_blocks, page)
        return cls(names, num_blocks, page, first.device, first.dtype, cross, per_layer, rows)

    def segments(self, block_ids: Sequence[int]) -> list[Segments]:
        if self._rows is None:
            raise ValueError(f"a {self.device.type} cache has no host segments: use new_staging and gather/scatter")
        return [self._rows.block(b) for b in block_ids]

    def new_staging(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.block_bytes), dtype=torch.uint8, device=self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        self._check(block_ids, out)
        if self._per_block is not None:
            for i, b in enumerate(block_ids):
                out[i].view(self.layers, self.page_bytes).copy_(self._per_block[b])
            return
        for i, b in enumerate(block_ids):
            row = out[i].view(self.layers, self.page_bytes)
            for layer, cache in enumerate(self._per_layer):
                row[layer].copy_(cache[b])

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        self._check(block_ids, src)
        if self._per_block is not None:
            for i, b in enumerate(block_ids):
                self._per_block[b].copy_(src[i].view(self.layers, self.page_bytes))
            return
        for i, b in enumerate(block_ids):
            row = src[i].view(self.layers, self.page_bytes)
            for layer, cache in enumerate(self._per_layer):
                cache[b].copy_(row[layer])

    def zero(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            for cache in self._per_layer:
                cache[b].zero_()

    def _check(self, block_ids: Sequence[int], buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.block_bytes:
            raise ValueError(f"buffer {tuple(buf.shape)} {buf.dtype} is not [n, {self.block_bytes}] uint8")
        if buf.shape[0] < len(block_ids):
            raise ValueError(f"buffer holds {buf.shape[0]} blocks, {len(block_ids)} asked")


def _cross_view(tensors: list[torch.Tensor], num_blocks: int, page: int) -> tuple[torch.Tensor, ...] | None:
    """Per-block ``[layers, page]`` views when all layers sit in one storage at a fixed distance apart."""
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
    cross = flat.as_strided((num_blocks, len(tensors), page), (page, step, 1), offsets[0])
    return tuple(cross.unbind(0))
