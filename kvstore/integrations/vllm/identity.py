"""Block identity for vLLM engines (DESIGN 2.1): fingerprint, namespace, hashes. Pure; imports no vLLM.

- ``EngineShape``: everything about an engine that changes the bytes of its KV blocks (model and revision,
  dtype, layers, kv heads, head size, block size, cache layout, tensor-parallel rank).
  ``EngineShape.from_vllm(vllm_config, model_id=None)`` reads it from a ``VllmConfig``.
- ``EngineShape.fingerprint(adapter="")``: the ``model_fingerprint`` string; ``adapter`` is a request's
  LoRA identity (``lora_adapter_id``), so two adapters never share a block.
- ``request_namespace(base, cache_salt)``: the tenant's namespace, with vLLM's ``cache_salt`` (if any)
  appended as ``BASE/salt-<16 hex of its SHA-256>``: a salt never appears in the store in the clear, and
  tenants granted ``BASE/*`` reach their salted namespaces.
- ``prompt_hashes(tokens, shape, namespace, adapter)``: the chained hash of every full block of the prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.hashing import block_hashes, model_fingerprint


@dataclass(frozen=True)
class EngineShape:
    model: str
    revision: str
    dtype: str
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    layout: str

    @classmethod
    def from_vllm(cls, vllm_config: Any, model_id: str | None = None) -> EngineShape:
        model_config, cache_config, parallel = (
            vllm_config.model_config,
            vllm_config.cache_config,
            vllm_config.parallel_config,
        )
        cache_dtype = str(cache_config.cache_dtype)
        dtype = str(model_config.dtype).removeprefix("torch.") if cache_dtype == "auto" else f"cache-{cache_dtype}"
        try:
            layout = cache_config.get_resolved_kv_cache_layout().name
        except (AttributeError, RuntimeError, ValueError):
            layout = "LBHNC"  # the scheduler may ask before the engine core has resolved it; CPU's only layout
        tp = f"tp{parallel.rank}of{parallel.tensor_parallel_size}" if parallel.tensor_parallel_size > 1 else "tp1"
        return cls(
            model=model_id or str(model_config.model),
            revision=str(model_config.revision or ""),
            dtype=dtype,
            layers=int(model_config.get_num_layers(parallel)),
            kv_heads=int(model_config.get_num_kv_heads(parallel)),
            head_size=int(model_config.get_head_size()),
            block_size=int(cache_config.block_size),
            layout=f"vllm-{layout}-{tp}",
        )

    def fingerprint(self, adapter: str = "") -> str:
        return model_fingerprint(
            model=self.model,
            revision=self.revision,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            layout=self.layout,
            adapter=adapter,
        )


def lora_adapter_id(lora_request: Any) -> str:
    """A LoRA request's identity in the fingerprint: its name, integer id and path (empty without LoRA)."""
    if lora_request is None:
        return ""
    name = getattr(lora_request, "lora_name", "") or ""
    int_id = getattr(lora_request, "lora_int_id", "")
    path = getattr(lora_request, "lora_path", "") or ""
    return f"lora:{name}:{int_id}:{path}"


def request_namespace(base: str, cache_salt: str | None) -> str:
    if not cache_salt:
        return base
    return f"{base}/salt-{hashlib.sha256(cache_salt.encode('utf-8')).hexdigest()[:16]}"


def prompt_hashes(tokens: Sequence[int], shape: EngineShape, namespace: str, adapter: str = "") -> list[bytes]:
    return block_hashes(list(tokens), shape.block_size, namespace, shape.fingerprint(adapter))
