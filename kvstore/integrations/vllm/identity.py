"""Block identity for vLLM engines (DESIGN 2.1): fingerprint, namespace, hashes. Pure; imports no vLLM.

- ``EngineShape``: everything about an engine that changes the bytes of its KV blocks (model and revision,
  dtype, layers, kv heads, head size, block size, cache layout, the worker's tensor- and pipeline-parallel
  rank). ``EngineShape.from_vllm(vllm_config, model_id=None, kv_cache_config=None)`` reads it from a
  ``VllmConfig``; a KV cache of more or fewer layers than the model has (a speculative decoder's draft layers,
  layers that share a cache) adds its layer count to the layout, so such blocks never meet a plain engine's.
- With several workers (tensor or pipeline parallel) each holds its own part of every block (its KV heads,
  its layers), so each rank's part is a store block of its own, under its own fingerprint: ``rank`` is this
  process's worker, ``rank_layouts`` every worker's layout, ``for_rank(r)`` worker r's shape, ``world`` how
  many there are. The scheduler side hashes a prompt once per rank; each worker moves its own rank's blocks.
  An MLA model's latent KV is the same on every tensor-parallel rank (its projection is replicated): those
  ranks share one layout (``tp1``, as an engine of one worker), and ``stores_saves`` is False on all but the
  first of them, whose Puts store the bytes for all.
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
from dataclasses import dataclass, replace
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
    layout: str  # this worker's, e.g. "vllm-LBHNC-tp1" (one worker) or "vllm-LBHNC-tp1of2"
    rank: int = 0  # this process's worker (vLLM's global rank: pipeline stage * tensor size + tensor rank)
    rank_layouts: tuple[str, ...] = ()  # every worker's layout, in rank order, when there are several

    @property
    def world(self) -> int:
        return max(1, len(self.rank_layouts))

    @property
    def stores_saves(self) -> bool:
        """This worker Puts its saves: no lower rank holds the same bytes (MLA's tensor-parallel ranks do)."""
        return not self.rank_layouts or self.rank_layouts.index(self.layout) == self.rank

    def for_rank(self, rank: int) -> EngineShape:
        """Worker ``rank``'s shape: the same engine, that worker's part of each block."""
        if not self.rank_layouts:
            return self
        return replace(self, layout=self.rank_layouts[rank], rank=rank)

    @classmethod
    def from_vllm(cls, vllm_config: Any, model_id: str | None = None, kv_cache_config: Any = None) -> EngineShape:
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
        tp, pp, pcp, dcp = (
            int(getattr(parallel, name, 1) or 1)
            for name in ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
                         "decode_context_parallel_size")
        )  # fmt: skip
        world = tp * pp * pcp  # vLLM's workers of one engine; ranks run tensor fastest, then context, then stage
        mla = bool(getattr(model_config, "use_mla", False))  # one latent per token, the same on every TP rank
        layers = int(model_config.get_num_layers(parallel))
        cached = sum(len(g.layer_names) for g in getattr(kv_cache_config, "kv_cache_groups", None) or ())
        extra = f"-kvlayers{cached}" if cached and cached != layers else ""

        def worker_layout(rank: int) -> str:
            if pcp == 1 and dcp == 1:
                part = (f"tp{rank % tp}of{tp}" if tp > 1 and not mla else "tp1") + (
                    f"-pp{rank // tp}of{pp}" if pp > 1 else ""
                )
            else:  # context parallel: ranks hold other tokens of a block too; the global rank names the worker
                part = f"rank{rank}of{world}-tp{tp}-pp{pp}-pcp{pcp}-dcp{dcp}"
            return f"vllm-{layout}-{part}{extra}"

        rank = int(getattr(parallel, "rank", 0) or 0) % world  # the scheduler's config says 0
        return cls(
            model=model_id or str(model_config.model),
            revision=str(model_config.revision or ""),
            dtype=dtype,
            layers=layers,
            kv_heads=int(model_config.get_num_kv_heads(parallel)),
            head_size=int(model_config.get_head_size()),
            block_size=int(cache_config.block_size),
            layout=worker_layout(rank),
            rank=rank,
            rank_layouts=tuple(worker_layout(r) for r in range(world)) if world > 1 else (),
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
