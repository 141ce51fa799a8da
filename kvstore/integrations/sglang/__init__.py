"""kvstore as an SGLang HiCache storage backend (the L3 tier behind SGLang's host memory pool).

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "target": "127.0.0.1:7070", "namespace": "team-a"}'

``interface_v1`` makes SGLang call ``batch_get_v1``/``batch_set_v1`` with host pool indices, which this backend
turns into the pool's own page buffers (``get_page_buffer_meta``): a Get writes the store's bytes straight into
SGLang's host pool and a Put reads them there, one copy per byte on the shm lane, as for the vLLM connector.

- ``storage.py``: ``KVStoreHiCacheStorage``, the ``HiCacheStorage`` subclass (imports SGLang).
- ``pages.py``: SGLang's page keys as store block hashes (model fingerprint mixed in) and host pool pages as
  ``Segments``; no SGLang import.

Importing this package does not import SGLang; ``KVStoreHiCacheStorage`` does, on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreHiCacheStorage":
        from kvstore.integrations.sglang.storage import KVStoreHiCacheStorage

        return KVStoreHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
