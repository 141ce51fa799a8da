"""Weights in Hugging Face Llama naming: random init, safetensors checkpoints.

Promises:

- ``expected_shapes(config)``: every tensor name (``model.embed_tokens.weight``,
  ``model.layers.N.self_attn.q_proj.weight``, ...) a Llama of this config
  has, with its ``[out, in]`` shape; ``lm_head.weight`` only when untied.
- ``random_state_dict(config, seed)``: deterministic for a given seed on any
  machine (seeded CPU generator); linear weights ~ N(0, 1/fan_in) so the
  attention is far from uniform even in a tiny model, norms all ones.
- ``load_checkpoint_dir(path)``: config and weights of a local HF Llama
  checkpoint (``config.json`` plus one or more ``*.safetensors`` files);
  nothing is downloaded. ``save_checkpoint_dir`` writes that same format.
- ``check_state_dict``: names and shapes match the config exactly, or a
  ``ValueError`` that lists what is missing, unexpected or misshapen.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvstore.model.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    c = config
    q_out, kv_out = c.heads * c.head_dim, c.kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab, c.hidden)}
    for i in range(c.layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (c.hidden,),
                p + "self_attn.q_proj.weight": (q_out, c.hidden),
                p + "self_attn.k_proj.weight": (kv_out, c.hidden),
                p + "self_attn.v_proj.weight": (kv_out, c.hidden),
                p + "self_attn.o_proj.weight": (c.hidden, q_out),
                p + "post_attention_layernorm.weight": (c.hidden,),
                p + "mlp.gate_proj.weight": (c.intermediate, c.hidden),
                p + "mlp.up_proj.weight": (c.intermediate, c.hidden),
                p + "mlp.down_proj.weight": (c.hidden, c.intermediate),
            }
        )
    shapes["model.norm.weight"] = (c.hidden,)
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab, c.hidden)
    return shapes


def check_state_dict(config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    want = expected_shapes(config)
    have = {k: tuple(v.shape) for k, v in state.items()}
    if config.tie_embeddings:
        have.pop("lm_head.weight", None)  # some tied checkpoints still store it
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want))
    bad = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if missing or unexpected or bad:
        raise ValueError(
            f"weights do not fit config {config.name!r}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape "
            f"{[(k, have[k], want[k]) for k in bad[:5]]}"
        )


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            w = torch.ones(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = torch.randn(shape, generator=gen)
        else:
            w = torch.randn(shape, generator=gen) * shape[1] ** -0.5
        out[name] = w.to(config.torch_dtype)
    return out


def load_checkpoint_dir(path: str | Path, *, dtype: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = Path(path)
    config = ModelConfig.from_hf_config(path, dtype=dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k: v.to(config.torch_dtype) for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    check_state_dict(config, state)
    return config, state


def save_checkpoint_dir(config: ModelConfig, state: dict[str, torch.Tensor], path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path
