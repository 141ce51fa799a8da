"""Real KV blocks: SmolLM2-135M-Instruct run on deterministic English text.

``smollm2_kv_blocks(num_tokens, block_size=16, dtype=torch.bfloat16, seed=0)``
returns ``ceil(num_tokens / block_size)`` full blocks, shaped
``[n_blocks, layers, 2, block_size, kv_heads, head_dim]`` (the page-first
payload layout of DESIGN 2.2), in ``dtype``. The text is built from the
paragraphs below, shuffled by ``seed`` and repeated as needed; the model runs
in fp32 over segments of ~1,024 tokens (each a fresh sequence from position
0, like a prompt) and the K/V are cast to ``dtype`` at the end. Same
arguments, same bytes. Results are cached on disk next to the model weights
(``gguf_loader.cache_dir()``), so benchmarks pay the compute once.
"""

from __future__ import annotations

import os
import random
from functools import lru_cache
from pathlib import Path

import torch

from kvstore.model.llama import LlamaModel
from kvstore.model.paged import PagedKVPool
from kvstore.model.tokenizer import ByteBPETokenizer

SEGMENT_TOKENS = 1024
_CACHE_VERSION = 1

PARAGRAPHS: tuple[str, ...] = (
    "The river had been rising for three days before anyone in the village took it seriously. "
    "Old Marta said she had seen it climb like this once, in the spring her father sold the mill, "
    "and that the water did not stop until it reached the chapel steps.",
    "A hash table stores each key in a bucket chosen by a hash function. When two keys land in the "
    "same bucket, the table must resolve the collision, either by chaining entries in a list or by "
    "probing for the next free slot. Good hash functions spread keys evenly, which keeps lookups fast.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, "
    "chlorophyll absorbs red and blue light, water molecules are split, and oxygen is released as a "
    "by-product. The energy captured is stored in the bonds of glucose.",
    "The committee met on Thursday to review the budget for the coming year. Several members argued "
    "that the library deserved more funding, since visits had doubled after the new reading room "
    "opened, while others wanted to repair the roads first.",
    "To make a simple bread, mix five hundred grams of flour with ten grams of salt, seven grams of "
    "yeast and about three hundred and fifty millilitres of warm water. Knead the dough for ten "
    "minutes, let it rise for an hour, shape it, and bake it at two hundred and twenty degrees.",
    "In 1969, the Apollo 11 mission landed two astronauts on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours outside the lunar module, collecting samples and setting up "
    "experiments, while Michael Collins orbited above in the command module.",
    "She opened the letter slowly, as if the words inside might change if she hurried. It was short: "
    "the house was hers, the garden needed work, and the cat, whose name was Pepper, came with it. "
    "She laughed for the first time in weeks.",
    "Interest rates affect almost every part of the economy. When a central bank raises its rate, "
    "borrowing becomes more expensive, businesses invest less, and households spend less on homes "
    "and cars. Inflation usually slows, but unemployment can rise.",
    "The migration of the Arctic tern is the longest of any animal. Each year the bird flies from its "
    "breeding grounds in the north to the Antarctic coast and back again, a round trip that can "
    "exceed seventy thousand kilometres.",
    "Dear team, thank you all for the hard work on the release. We shipped on time, the error rate is "
    "down by forty percent, and customers have noticed. Please take Friday off; we will plan the next "
    "quarter on Monday morning.",
    "Shakespeare wrote about thirty-seven plays, among them tragedies such as Hamlet, Othello and "
    "King Lear, and comedies such as Twelfth Night. His language shaped modern English: phrases like "
    "'break the ice' and 'wild-goose chase' first appear in his work.",
    "A good night's sleep matters more than most people think. Adults need seven to nine hours; "
    "during deep sleep the body repairs tissue, and during dreaming sleep the brain sorts memories. "
    "Caffeine late in the day and bright screens at night both make sleep worse.",
    "The train left the station at 6:45 and followed the coast for an hour before turning inland. "
    "Through the window the fields were grey with frost, and every few minutes a farmhouse appeared, "
    "its chimney smoking, and vanished behind a hedge.",
    "Vaccines train the immune system to recognise a pathogen without causing the disease. They "
    "contain a weakened or inactive part of the germ, or instructions for making one of its proteins, "
    "so that the body can respond quickly if the real infection arrives.",
    "Why do cats knock things off tables? Scientists are not sure, but the most popular explanation "
    "is curiosity mixed with hunting instinct: a small object that moves when touched behaves a bit "
    "like prey. Some cats also learn that it gets their owner's attention.",
    "The new bridge will have four lanes for cars, two for bicycles and a wide path for pedestrians. "
    "Construction should take three years and cost about 120 million euros, of which the national "
    "government will pay sixty percent.",
)


def english_text(min_chars: int, seed: int = 0) -> str:
    """Deterministic English prose of at least ``min_chars`` characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < min_chars:
        order = list(PARAGRAPHS)
        rng.shuffle(order)
        for p in order:
            parts.append(p)
            size += len(p) + 2
    return "\n\n".join(parts)


def english_tokens(tokenizer: ByteBPETokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``num_tokens`` token ids of ``english_text``."""
    chars = max(num_tokens * 6, 1024)
    while True:
        ids = tokenizer.encode(english_text(chars, seed), allow_special=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        chars *= 2


@lru_cache(maxsize=1)
def _smollm2() -> tuple[LlamaModel, ByteBPETokenizer]:
    from kvstore.model import load_model

    model, tokenizer = load_model("smollm2", dtype="float32")
    assert tokenizer is not None
    return model, tokenizer


def smollm2_kv_blocks(
    num_tokens: int,
    *,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> torch.Tensor:
    """Real SmolLM2 KV of English text: ``[n_blocks, layers, 2, block_size, kv_heads, head_dim]``."""
    if num_tokens < 1 or block_size < 1:
        raise ValueError("num_tokens and block_size must be >= 1")
    n_blocks = -(-num_tokens // block_size)
    cached = _cache_path(n_blocks, block_size, dtype, seed)
    if cached is not None and cached.exists():
        from safetensors.torch import load_file

        return load_file(str(cached))["kv"]
    model, tokenizer = _smollm2()
    tokens = english_tokens(tokenizer, n_blocks * block_size, seed)
    seg_blocks = max(1, SEGMENT_TOKENS // block_size)
    out = torch.empty((n_blocks, *model.config.with_(block_size=block_size).kv_block_shape), dtype=dtype)
    pool = PagedKVPool(model.config, seg_blocks, block_size=block_size)
    for first in range(0, n_blocks, seg_blocks):
        last = min(first + seg_blocks, n_blocks)
        pool.add_sequence(first)
        model.prefill(pool, first, tokens[first * block_size : last * block_size], logits="none")
        table = torch.tensor(pool.block_table(first))
        out[first:last] = pool.kv[table].to(dtype)
        pool.free_sequence(first)
    if cached is not None:
        _save(out, cached)
    return out


def _cache_path(n_blocks: int, block_size: int, dtype: torch.dtype, seed: int) -> Path | None:
    from kvstore.model.gguf_loader import find_smollm2_gguf
    from kvstore.model.model_cache import cache_dir, cache_key

    try:
        stem = cache_key(find_smollm2_gguf())
    except (FileNotFoundError, OSError):
        return None
    dt = str(dtype).removeprefix("torch.")
    return cache_dir() / "real_kv" / f"{stem}-v{_CACHE_VERSION}-n{n_blocks}-b{block_size}-{dt}-s{seed}.safetensors"


def _save(kv: torch.Tensor, path: Path) -> None:
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file({"kv": kv.contiguous()}, str(tmp))
        os.replace(tmp, path)
    except OSError:
        pass  # caching is an optimisation only
