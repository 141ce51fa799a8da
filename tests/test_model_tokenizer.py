"""Byte-level BPE tokenizer from SmolLM2's GGUF metadata: round trips, known ids, chat template, HF parity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.model.tokenizer import ByteBPETokenizer, TokenizerSpec, bytes_to_unicode

TEXTS = [
    "Hello world, 12345",
    "The quick brown fox jumps over the lazy dog.\n\nNew paragraph\twith a tab.   ",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト, العربية, עברית",
    "Emoji 👍🏽👨‍👩‍👧 and symbols ∑∫√∞ ≠ ≤ → ½ ² ٣ 𝔘𝔫𝔦",
    "Combining: e\u0301 a\u0308 \u200b zero width, \u00a0nbsp, \r\n windows line",
    "def f(x):\n    return x**2  # it's 'quoted' and \"double\"\n\n\n",
    "I'm sure they've said we'll go, you'd think, it's DON'T SHOUT",
    "   leading spaces and trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "numbers 3.14159, 1,000,000 and 2024-11-30T12:00Z",
    "",
]


@pytest.fixture(scope="module")
def spec() -> TokenizerSpec:
    from kvstore.model.gguf_loader import find_smollm2_gguf, load_gguf

    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_gguf(path)[2]


@pytest.fixture(scope="module")
def tok(spec: TokenizerSpec) -> ByteBPETokenizer:
    return ByteBPETokenizer(spec)


def test_bytes_to_unicode_is_a_bijection() -> None:
    m = bytes_to_unicode()
    assert sorted(m) == list(range(256)) and len(set(m.values())) == 256
    assert m[ord(" ")] == "Ġ" and m[ord("A")] == "A"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: ByteBPETokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(derandomize=True, deadline=None, max_examples=150)
@given(st.text(max_size=60))
def test_round_trip_any_text(tok: ByteBPETokenizer, text: str) -> None:
    ids = tok.encode(text, allow_special=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    missing = tok.missing_bytes
    if not missing.intersection(text.encode("utf-8")):
        assert tok.decode(ids) == text
    else:  # bytes without a token are dropped, as Hugging Face's tokenizer does
        kept = bytes(b for b in text.encode("utf-8") if b not in missing)
        assert tok.decode(ids) == kept.decode("utf-8", errors="replace")


def test_bytes_missing_from_the_vocabulary(tok: ByteBPETokenizer) -> None:
    assert {0x04, 0xC0, 0xC1, 0xF5, 0xFF} <= tok.missing_bytes and len(tok.missing_bytes) == 21
    assert tok.decode(tok.encode("a\x04b")) == "ab"


def test_known_ids(tok: ByteBPETokenizer) -> None:
    # Reference ids from Hugging Face's tokenizer for this model: digits are split one by one.
    assert tok.encode("Hello world, 12345") == [19556, 905, 28, 216, 33, 34, 35, 36, 37]
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.encode("<|im_start|>", allow_special=False) != [1]


def test_special_tokens_decode_or_skip(tok: ByteBPETokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "assistant\nHi"
    assert tok.eos_id == tok.token_id("<|im_end|>") and tok.stop_ids == {tok.eos_id}


def test_chat_template_matches_chatml_with_default_system(tok: ByteBPETokenizer) -> None:
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )
    assert tok.encode_chat(msgs)[:1] == [tok.token_id("<|im_start|>")]


def test_spec_json_round_trip(spec: TokenizerSpec) -> None:
    assert TokenizerSpec.from_json(spec.to_json()) == spec


def test_unknown_pre_tokenizer_is_refused(spec: TokenizerSpec) -> None:
    bad = TokenizerSpec(**{**spec.__dict__, "pre": "no-such-regex"})
    with pytest.raises(ValueError, match="pre-tokenizer"):
        ByteBPETokenizer(bad)


def test_ids_match_transformers(tok: ByteBPETokenizer) -> None:
    """Parity with Hugging Face's tokenizer for SmolLM2.

    transformers' GGUF converter builds a plain ByteLevel pre-tokenizer and
    drops SmolLM2's first step, which isolates every numeric character
    (``Digits(individual_digits=True)`` in the model's tokenizer.json; the
    ``smollm`` pre-tokenizer in llama.cpp). The reference puts it back.
    """
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    from kvstore.model.gguf_loader import find_smollm2_gguf

    path = find_smollm2_gguf()
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    chat = tok.apply_chat_template([{"role": "user", "content": "Tell me about Paris in 2 lines."}])
    for text in [*TEXTS, chat, "x" * 300 + " 1234567890" * 5, "ctrl \x04\x06 plane-4 \U00040000 end"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
