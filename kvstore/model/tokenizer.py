"""Byte-level BPE tokenizer built from GGUF metadata, plus the ChatML chat template.

Promises:

- ``TokenizerSpec`` is the plain data (vocabulary, merges, token types,
  special ids, pre-tokenizer name, chat template) read from
  ``tokenizer.ggml.*``; it round-trips through JSON for the on-disk cache.
- ``ByteBPETokenizer.encode(text)`` gives the ids Hugging Face's tokenizer
  gives for the same model: control tokens written literally in the text
  (``<|im_start|>``) become their ids, the rest is pre-tokenized by the
  model's regex (``smollm``: each digit alone, then the GPT-2 pattern),
  mapped to GPT-2's byte-to-unicode alphabet and merged by rank.
- ``decode(encode(text)) == text`` for any text whose UTF-8 bytes all have
  a token. A byte-level vocabulary may lack a few bytes (SmolLM2's lacks 21:
  some ASCII controls such as 0x04, bytes never valid in UTF-8, and the lead
  bytes of unassigned planes 4-11); such bytes are dropped, exactly as
  Hugging Face's tokenizer for the model drops them. ``missing_bytes`` lists them.
- ``apply_chat_template(messages)`` renders ChatML
  (``<|im_start|>role\\ncontent<|im_end|>\\n``), adding the model's default
  system message when the first message is not a system one.
"""

from __future__ import annotations

import json
import re as stdlib_re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# GGUF `tokenizer.ggml.pre` -> (split digits one by one first?, main pattern)
PRE_TOKENIZERS: dict[str, tuple[bool, str]] = {
    "smollm": (True, GPT2_PATTERN),
    "starcoder": (True, GPT2_PATTERN),
    "gpt2": (False, GPT2_PATTERN),
    "llama-bpe": (False, LLAMA3_PATTERN),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types matched literally in text


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything needed to rebuild the tokenizer, as read from GGUF metadata."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    pre: str
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> TokenizerSpec:
        return cls(**json.loads(text))


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class ByteBPETokenizer:
    """GPT-2 style byte-level BPE with literal special tokens."""

    def __init__(self, spec: TokenizerSpec):
        if spec.pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {spec.pre!r} not supported (known: {sorted(PRE_TOKENIZERS)})")
        self.spec = spec
        split_digits, pattern = PRE_TOKENIZERS[spec.pre]
        self._split_digits = split_digits
        self._pattern = regex.compile(pattern)
        self._vocab = {tok: i for i, tok in enumerate(spec.tokens)}
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(spec.merges):
            a, b = merge.split(" ", 1)
            self._ranks[(a, b)] = rank
        self._byte_enc = bytes_to_unicode()
        self._byte_dec = {c: b for b, c in self._byte_enc.items()}
        self.special_ids = {i for i, t in enumerate(spec.token_types) if t in (CONTROL, USER_DEFINED)}
        specials = sorted((spec.tokens[i] for i in self.special_ids), key=len, reverse=True)
        self._special_re = (
            stdlib_re.compile("(" + "|".join(map(stdlib_re.escape, specials)) + ")") if specials else None
        )
        self._cache: dict[str, list[int]] = {}
        self.default_system = _default_system(spec.chat_template)

    # -- properties ---------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.spec.tokens)

    @property
    def eos_id(self) -> int | None:
        return self.spec.eos_id

    @property
    def missing_bytes(self) -> set[int]:
        """Bytes without a token: dropped by ``encode``."""
        return {b for b, c in self._byte_enc.items() if c not in self._vocab}

    def token_id(self, token: str) -> int:
        return self._vocab[token]

    @property
    def stop_ids(self) -> set[int]:
        """Ids that end an assistant turn (EOS and ``<|im_end|>`` where present)."""
        out = {self.spec.eos_id} if self.spec.eos_id is not None else set()
        if "<|im_end|>" in self._vocab:
            out.add(self._vocab["<|im_end|>"])
        return out

    # -- encode / decode ------------------------------------------------------------
    def encode(self, text: str, *, allow_special: bool = True, add_bos: bool | None = None) -> list[int]:
        ids: list[int] = []
        if add_bos if add_bos is not None else self.spec.add_bos:
            if self.spec.bos_id is None:
                raise ValueError("this tokenizer has no BOS token")
            ids.append(self.spec.bos_id)
        pieces = self._special_re.split(text) if (allow_special and self._special_re) else [text]
        for i, piece in enumerate(pieces):
            if i % 2 == 1:  # a captured special token
                ids.append(self._vocab[piece])
            elif piece:
                for word in self._pre_tokenize(piece):
                    ids.extend(self._bpe(word))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        out = bytearray()
        for i in ids:
            tok = self.spec.tokens[int(i)]
            if int(i) in self.special_ids:
                if not skip_special:
                    out += tok.encode("utf-8")
            else:
                out += bytes(self._byte_dec[c] for c in tok)
        return out.decode("utf-8", errors="replace")

    # -- chat --------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        parts: list[str] = []
        if messages and messages[0]["role"] != "system" and self.default_system is not None:
            parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
        for m in messages:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))

    # -- internals -----------------------------------------------------------------
    def _pre_tokenize(self, text: str) -> list[str]:
        chunks = [c for c in regex.split(r"(\p{N})", text) if c] if self._split_digits else [text]
        words: list[str] = []
        for chunk in chunks:
            words.extend(self._pattern.findall(chunk))
        return words

    def _bpe(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        parts = [self._byte_enc[b] for b in word.encode("utf-8")]
        ranks = self._ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for pair in zip(parts, parts[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == best[0] and parts[i + 1] == best[1]:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        vocab = self._vocab
        ids = [vocab[p] for p in parts if p in vocab]  # only lone bytes can be missing
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids


def _default_system(template: str | None) -> str | None:
    if not template:
        return None
    m = stdlib_re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, stdlib_re.DOTALL)
    return m.group(1) if m else None


def load_tokenizer_spec(path: str | Path) -> TokenizerSpec:
    return TokenizerSpec.from_json(Path(path).read_text(encoding="utf-8"))
