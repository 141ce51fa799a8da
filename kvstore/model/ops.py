"""Numerical building blocks of the Llama decoder, written to match Hugging Face.

- ``rms_norm(x, weight, eps)``: RMSNorm computed in fp32, scaled in x's dtype.
- ``rope_inv_freq(config)``: RoPE inverse frequencies, with ``linear`` or
  ``llama3`` scaling when the config asks for it.
- ``rope_cos_sin(inv_freq, positions, dtype)``: cos/sin tables ``[n, head_dim]``
  for absolute token positions (HF layout: the two halves repeat).
- ``apply_rope(x, cos, sin)``: the standard ``rotate_half`` rotation of
  ``x: [n, heads, head_dim]``. Weights from GGUF are un-permuted at load time
  (``gguf_loader``) so this one form serves every checkpoint.
- ``swiglu(gate_up)``: ``silu(gate) * up`` of a fused ``[n, 2*intermediate]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvstore.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [n, heads, head_dim]`` by the tables ``[n, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
