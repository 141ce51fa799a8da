"""What the SGLang backend needs that is not SGLang: block identity and host pool pages as ``Segments``.

- ``PageKeys(fingerprint)``: SGLang names each page by a hex SHA-256 chained over the prompt's pages (seeded by
  the request's ``cache_salt`` and extra key), so equal prefixes already share keys. ``hashes(keys)`` maps them to
  the store's 16-byte block hashes, keyed by the model fingerprint (model, PP/CP rank, the TP rank for MHA,
  layout, dtype, page geometry), so two deployments whose bytes differ never share a block.
- ``fingerprint(...)``: that fingerprint, from SGLang's storage config and host pool.
- ``page_segments(ptrs, sizes, pages)``: the flat (pointer, bytes) list of ``get_page_buffer_meta`` for
  ``pages`` pages, as one ``Segments`` per page over the pool's memory (no copy).
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.client import Segments

HASH_BYTES = 16


def fingerprint(config: Any, pool: Any) -> str:
    """The fields of SGLang's ``HiCacheStorageConfig`` and host pool that change a page's bytes. An MHA page
    holds this TP rank's heads, so the rank is part of it; MLA's latent KV is the same on every TP rank, so
    the ranks share its pages (as SGLang's own file backend keys them)."""
    mla = bool(getattr(config, "is_mla_model", False))
    parts = [
        f"model={getattr(config, 'model_name', '')}",
        f"pp={getattr(config, 'pp_rank', 0)}/{getattr(config, 'pp_size', 1)}",
        f"cp={getattr(config, 'attn_cp_rank', 0)}/{getattr(config, 'attn_cp_size', 1)}",
        f"dcp={getattr(config, 'dcp_rank', 0)}/{getattr(config, 'dcp_size', 1)}",
        f"mla={mla}",
    ]
    if not mla:
        parts.append(f"tp={getattr(config, 'tp_rank', 0)}/{getattr(config, 'tp_size', 1)}")
    for name in ("layout", "dtype", "page_size", "layer_num", "head_num", "head_dim", "start_layer", "end_layer"):
        parts.append(f"{name}={getattr(pool, name, '')}")
    return "sglang;" + ";".join(parts)


class PageKeys:
    def __init__(self, fingerprint: str):
        self._key = hashlib.blake2b(fingerprint.encode(), digest_size=32).digest()

    def hash(self, key: str) -> bytes:
        return hashlib.blake2b(key.encode(), digest_size=HASH_BYTES, key=self._key).digest()

    def hashes(self, keys: Sequence[str]) -> list[bytes]:
        return [self.hash(k) for k in keys]


def page_segments(ptrs: Sequence[int], sizes: Sequence[int], pages: int) -> list[Segments]:
    """One ``Segments`` per page over the pool's memory; ``ptrs`` and ``sizes`` list the pages' parts in order
    (``len(ptrs)`` a multiple of ``pages``: every page has the same parts, as SGLang's pools lay them out)."""
    if len(ptrs) != len(sizes):
        raise ValueError(f"{len(ptrs)} pointers but {len(sizes)} sizes")
    if pages <= 0 or len(ptrs) % pages:
        raise ValueError(f"{len(ptrs)} page parts do not split into {pages} pages")
    per = len(ptrs) // pages
    parts = [_at(int(p), int(n)) for p, n in zip(ptrs, sizes)]
    return [Segments(tuple(parts[i * per : (i + 1) * per])) for i in range(pages)]


def _at(address: int, n: int) -> np.ndarray:
    """The ``n`` bytes at ``address`` (memory the pool owns and keeps) as a writable uint8 array."""
    if address <= 0 or n <= 0:
        raise ValueError(f"page part at {address:#x} of {n} bytes")
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))
