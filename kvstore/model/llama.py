"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV pool.

Inference only. Verbs and their promises:

- ``forward(pool, batch, logits=...)``: one step of continuous batching.
  ``batch`` is a list of ``(seq_id, new_tokens)``; every sequence must
  already exist in ``pool`` (``pool.add_sequence``) and whatever it holds
  there (shared prefix blocks, blocks loaded from the store, earlier chunks)
  is its context. The new tokens' K/V are written into the pool and
  attention reads all K/V through the block tables. Sequences of different
  lengths mix freely: one-token rows (decode) share one padded attention
  call, longer rows (prefill chunks) get one causal call each. Capacity is
  checked up front: ``OutOfBlocks`` leaves the pool unchanged.
- ``prefill(pool, seq, tokens, chunk_size=None)``: ``forward`` for one
  sequence, optionally in chunks (chunked prefill); ``iter_prefill`` yields
  after each chunk the range of blocks that just became full, so the worker
  can Put them while the next chunk computes.
- ``decode(pool, seqs, tokens)``: one new token for each sequence.
- Logits come back in fp32: ``"last"`` gives ``[len(batch), vocab]``,
  ``"all"`` gives ``[total_new_tokens, vocab]`` in batch order, ``"none"``
  skips the LM head (intermediate prefill chunks).

CPU only, and not thread-safe: one ``forward`` at a time per pool.
Numerics follow Hugging Face's ``LlamaForCausalLM`` (fp32 by default, bf16 or
fp16 when the config says so); projections are fused (QKV, gate+up) for speed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, TypeVar

import torch
import torch.nn.functional as F

from kvstore.model.allocator import OutOfBlocks
from kvstore.model.block_manager import SeqId
from kvstore.model.config import ModelConfig
from kvstore.model.ops import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, swiglu
from kvstore.model.paged import PagedKVPool, Slots
from kvstore.model.weights import check_state_dict, random_state_dict

LogitsMode = Literal["last", "all", "none"]
TokenChunk: TypeAlias = Sequence[int] | torch.Tensor
F_ = TypeVar("F_")


def _inference_mode(fn: F_) -> F_:
    """``torch.inference_mode()`` as a decorator that keeps the function's type (torch is unchecked here)."""
    wrapped: F_ = torch.inference_mode()(fn)
    return wrapped


@dataclass(frozen=True)
class ChunkDone:
    """Progress of a chunked prefill after one chunk."""

    tokens_done: int  # tokens of the sequence now held in the pool
    full_blocks: range  # block-table indices that became full during this chunk
    logits: torch.Tensor | None


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2*kv_heads) * head_dim, hidden]
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


@dataclass
class _Prefill:
    rows: slice
    table: torch.Tensor
    length: int
    mask: torch.Tensor | None  # None: plain causal (the chunk starts the sequence)


@dataclass
class _Decode:
    rows: torch.Tensor
    table: torch.Tensor  # [B, max_blocks]
    length: int  # keys to read (max over the batch)
    mask: torch.Tensor | None  # [B, 1, 1, length], None for a single sequence


class LlamaModel:
    """Weights plus a stateless forward pass; all per-sequence state lives in the pool."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor]):
        check_state_dict(config, state)
        self.config = config
        dt = config.torch_dtype

        def get(name: str) -> torch.Tensor:
            return state[name].to(dt).contiguous()

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_embeddings else get("lm_head.weight")
        self.norm = get("model.norm.weight")
        self.layers: list[_Layer] = []
        for i in range(config.layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=get(p + "input_layernorm.weight"),
                    qkv=torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                    o=get(p + "self_attn.o_proj.weight"),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                    down=get(p + "mlp.down_proj.weight"),
                )
            )
        self.inv_freq = rope_inv_freq(config)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> LlamaModel:
        return cls(config, random_state_dict(config, seed))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face names (views into the fused tensors)."""
        c = self.config
        q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not c.tie_embeddings:
            out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            wq, wk, wv = layer.qkv.split([q, kv, kv])
            gate, up = layer.gate_up.chunk(2)
            out.update(
                {
                    p + "input_layernorm.weight": layer.attn_norm,
                    p + "self_attn.q_proj.weight": wq,
                    p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv,
                    p + "self_attn.o_proj.weight": layer.o,
                    p + "post_attention_layernorm.weight": layer.mlp_norm,
                    p + "mlp.gate_proj.weight": gate,
                    p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer.down,
                }
            )
        return out

    def new_pool(self, num_blocks: int, *, block_size: int | None = None) -> PagedKVPool:
        return PagedKVPool(self.config, num_blocks, block_size=block_size)

    # -- verbs ------------------------------------------------------------------------
    def iter_prefill(
        self,
        pool: PagedKVPool,
        seq_id: SeqId,
        tokens: TokenChunk,
        chunk_size: int,
        *,
        logits: LogitsMode = "last",
    ) -> Iterator[ChunkDone]:
        """Chunked prefill that reports, after each chunk, which blocks just became full.

        The prefill worker Puts ``pool.sequence_payloads(seq_id, r.start, r.stop)``
        for each chunk's ``full_blocks`` range while the next chunk computes.
        ``logits`` applies to the last chunk ("all": to every chunk).
        """
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        bs = pool.block_size
        for s in range(0, len(toks), chunk_size):
            final = s + chunk_size >= len(toks)
            mode: LogitsMode = logits if (final or logits == "all") else "none"
            before = pool.num_tokens(seq_id) // bs
            out = self.forward(pool, [(seq_id, toks[s : s + chunk_size])], logits=mode)
            done = pool.num_tokens(seq_id)
            yield ChunkDone(tokens_done=done, full_blocks=range(before, done // bs), logits=out)

    def prefill(
        self,
        pool: PagedKVPool,
        seq_id: SeqId,
        tokens: TokenChunk,
        *,
        logits: LogitsMode = "last",
        chunk_size: int | None = None,
    ) -> torch.Tensor | None:
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        outs = [
            c.logits
            for c in self.iter_prefill(pool, seq_id, toks, chunk_size or max(len(toks), 1), logits=logits)
            if c.logits is not None
        ]
        if not outs:
            return None
        return outs[-1] if logits == "last" else torch.cat(outs)

    def decode(self, pool: PagedKVPool, seq_ids: Sequence[SeqId], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if len(toks) != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} sequences but {len(toks)} tokens")
        out = self.forward(pool, [(s, toks[i : i + 1]) for i, s in enumerate(seq_ids)], logits="last")
        assert out is not None
        return out

    @_inference_mode
    def forward(
        self,
        pool: PagedKVPool,
        batch: Sequence[tuple[SeqId, TokenChunk]],
        *,
        logits: LogitsMode = "last",
    ) -> torch.Tensor | None:
        c = self.config
        if pool.device.type != "cpu":
            raise ValueError(f"this runtime computes on CPU; the pool lives on {pool.device}")
        if pool.config.layers != c.layers or pool.config.kv_heads != c.kv_heads or pool.config.head_dim != c.head_dim:
            raise ValueError("pool was built for a different model shape")
        seq_ids = [s for s, _ in batch]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence may appear only once per forward step")
        chunks = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for _, t in batch]
        if any(len(t) == 0 for t in chunks):
            raise ValueError("every sequence in a step needs at least one new token")
        needed = sum(pool.manager.blocks_needed(s, len(t)) for s, t in zip(seq_ids, chunks))
        if needed > pool.num_free_blocks:
            raise OutOfBlocks(needed, pool.num_free_blocks)

        slots = [pool.append_slots(s, len(t)) for s, t in zip(seq_ids, chunks)]
        tokens = torch.cat(chunks)
        positions = torch.cat([torch.arange(sl.start, sl.start + len(t)) for sl, t in zip(slots, chunks)])
        flat = Slots(
            start=0, blocks=torch.cat([s.blocks for s in slots]), offsets=torch.cat([s.offsets for s in slots])
        )
        prefills, decode = self._plan_attention(pool, seq_ids, slots, [len(t) for t in chunks])
        cos, sin = rope_cos_sin(self.inv_freq, positions, c.torch_dtype)

        n, hd = len(tokens), c.head_dim
        x = self.embed[tokens]
        for li, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_eps)
            q, k, v = F.linear(h, layer.qkv).split([c.heads * hd, c.kv_heads * hd, c.kv_heads * hd], dim=-1)
            q = apply_rope(q.reshape(n, c.heads, hd), cos, sin)
            k = apply_rope(k.reshape(n, c.kv_heads, hd), cos, sin)
            pool.write_kv(li, flat, k, v.reshape(n, c.kv_heads, hd))
            attn = self._attend(pool, li, q, prefills, decode)
            x = x + F.linear(attn, layer.o)
            h = rms_norm(x, layer.mlp_norm, c.rms_eps)
            x = x + F.linear(swiglu(F.linear(h, layer.gate_up)), layer.down)

        if logits == "none":
            return None
        if logits == "last":
            ends = torch.tensor([len(t) for t in chunks]).cumsum(0) - 1
            x = x[ends]
        return F.linear(rms_norm(x, self.norm, c.rms_eps), self.lm_head).float()

    # -- attention ----------------------------------------------------------------------
    def _plan_attention(
        self,
        pool: PagedKVPool,
        seq_ids: list[SeqId],
        slots: list[Slots],
        lens: list[int],
    ) -> tuple[list[_Prefill], _Decode | None]:
        """Block tables and masks, built once per step and reused by every layer."""
        prefills: list[_Prefill] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        row = 0
        for sid, sl, n in zip(seq_ids, slots, lens):
            state = pool.manager.state(sid)
            total = state.num_tokens
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(state.table)
                dec_lens.append(total)
            else:
                mask = None
                if sl.start > 0:
                    q_pos = torch.arange(sl.start, total)[:, None]
                    mask = torch.arange(total)[None, :] <= q_pos
                prefills.append(_Prefill(slice(row, row + n), torch.tensor(state.table), total, mask))
            row += n
        decode = None
        if dec_rows:
            width = max(len(t) for t in dec_tables)
            table = torch.tensor([t + [t[0]] * (width - len(t)) for t in dec_tables])
            length = max(dec_lens)
            mask = None
            if len(dec_rows) > 1:
                mask = (torch.arange(length)[None, :] < torch.tensor(dec_lens)[:, None])[:, None, None, :]
            decode = _Decode(torch.tensor(dec_rows), table, length, mask)
        return prefills, decode

    def _attend(
        self,
        pool: PagedKVPool,
        layer: int,
        q: torch.Tensor,
        prefills: list[_Prefill],
        decode: _Decode | None,
    ) -> torch.Tensor:
        """Attention output ``[n, heads * head_dim]`` for the queries ``q: [n, heads, head_dim]``."""
        n, heads, hd = q.shape
        if decode is not None and not prefills:
            return self._attend_decode(pool, layer, q, decode).reshape(n, heads * hd)
        out = torch.empty(n, heads, hd, dtype=q.dtype)
        for p in prefills:
            k, v = pool.gather_kv(layer, p.table)
            k, v = k[:, : p.length].unsqueeze(0), v[:, : p.length].unsqueeze(0)
            qs = q[p.rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs,
                k,
                v,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                enable_gqa=True,
            )
            out[p.rows] = o[0].transpose(0, 1)
        if decode is not None:
            out[decode.rows] = self._attend_decode(pool, layer, q[decode.rows], decode)
        return out.reshape(n, heads * hd)

    def _attend_decode(self, pool: PagedKVPool, layer: int, q: torch.Tensor, d: _Decode) -> torch.Tensor:
        k, v = pool.gather_kv(layer, d.table)  # [B, kv_heads, width * bs, hd]
        k, v = k[:, :, : d.length], v[:, :, : d.length]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=d.mask, enable_gqa=True)
        return o.squeeze(2)
