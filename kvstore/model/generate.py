"""Greedy generation on top of ``LlamaModel.forward`` (continuous batching).

- ``greedy_generate(model, pool, prompts, max_new_tokens)``: prefill every
  prompt (in chunks of ``chunk_size`` if given), then decode all unfinished
  sequences together, one token per step, each leaving the batch when it
  emits a stop id or reaches ``max_new_tokens``. Deterministic: argmax, ties
  to the lowest id. A sequence already present in the pool keeps its
  blocks (cached prefix) and only its remaining prompt tokens are computed;
  sequences are left in the pool for the caller to free.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from kvstore.model.block_manager import SeqId
from kvstore.model.llama import LlamaModel
from kvstore.model.paged import PagedKVPool


def greedy_generate(
    model: LlamaModel,
    pool: PagedKVPool,
    prompts: Mapping[SeqId, Sequence[int]],
    max_new_tokens: int,
    *,
    stop_ids: Collection[int] = (),
    chunk_size: int | None = None,
) -> dict[SeqId, list[int]]:
    out: dict[SeqId, list[int]] = {sid: [] for sid in prompts}
    if max_new_tokens <= 0:
        return out
    last: dict[SeqId, int] = {}
    for sid, prompt in prompts.items():
        if sid not in pool.manager:
            pool.add_sequence(sid)
        done = pool.num_tokens(sid)
        if done >= len(prompt):
            raise ValueError(f"sequence {sid!r} holds {done} tokens: nothing left of its prompt to compute")
        logits = model.prefill(pool, sid, list(prompt)[done:], chunk_size=chunk_size)
        assert logits is not None
        last[sid] = int(torch.argmax(logits[-1]))
    active = list(prompts)
    while active:
        for sid in active:
            out[sid].append(last[sid])
        active = [s for s in active if last[s] not in stop_ids and len(out[s]) < max_new_tokens]
        if not active:
            break
        logits = model.decode(pool, active, [last[s] for s in active])
        for sid, row in zip(active, logits):
            last[sid] = int(torch.argmax(row))
    return out
