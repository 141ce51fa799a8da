"""kvstore as a vLLM v1 KV connector (DESIGN 2.4).

    KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both",  # kv_producer saves, kv_consumer loads, kv_both does both
        kv_connector_extra_config={"target": "127.0.0.1:7070", "namespace": "team-a"},
    )

The package's parts, each in its own file:

- ``connector.py``: ``KVStoreConnector``, the class vLLM instantiates twice (scheduler role, worker role);
  it only routes each verb to one of the two sides below.
- ``scheduler.py`` (scheduler process): Lookup, the load and save plans, request lifetimes.
- ``worker.py`` (worker process): Gets into the KV cache, the background saver, load errors.
- ``plan.py``: the small picklable per-step plan that is all the two sides share.
- ``identity.py``: model fingerprint, namespaces and block hashes (DESIGN 2.1).
- ``settings.py``: the ``kv_connector_extra_config`` keys.
- ``cache_blocks.py``: one vLLM block across all layers of the KV cache, gathered and scattered.

Importing this package does not import vLLM; ``KVStoreConnector`` does, on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from kvstore.integrations.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
