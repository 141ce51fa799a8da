"""SmolLM2-135M-Instruct: our GGUF loader and paged runtime against Hugging Face transformers.

The reference model is built by transformers' own GGUF loader (its own
dequantization and Q/K un-permutation), so a mistake in ours shows up here.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.model import load_model
from kvstore.model.generate import greedy_generate
from kvstore.model.llama import LlamaModel
from kvstore.model.real_kv import english_tokens, smollm2_kv_blocks
from kvstore.model.tokenizer import ByteBPETokenizer

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain what a hash table is."}],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two spinning OpenMP threads
    run several times slower than one whenever another process wants a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ours() -> tuple[LlamaModel, ByteBPETokenizer]:
    try:
        model, tok = load_model("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    assert tok is not None
    return model, tok


@pytest.fixture(scope="module")
def hf(ours: tuple[LlamaModel, ByteBPETokenizer]):  # -> transformers.LlamaForCausalLM
    """Hugging Face's Llama holding the same weights (checked against HF's own GGUF
    processing in ``test_weights_match_transformers_gguf_processing``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.initialization import no_init_weights

    cfg = ours[0].config
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf_config().items() if not k.startswith("_")})
    with no_init_weights():
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(ours[0].state_dict(), strict=False)  # lm_head is tied to the embedding
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _prompts(tok: ByteBPETokenizer) -> list[list[int]]:
    code = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n"
    return [tok.encode_chat(c) for c in CHATS] + [tok.encode(code), english_tokens(tok, 256, seed=1)]


def _prefill(model: LlamaModel, tokens: list[int], chunk: int | None = None) -> torch.Tensor:
    pool = model.new_pool(len(tokens) // 16 + 2)
    pool.add_sequence(0)
    out = model.prefill(pool, 0, tokens, logits="all", chunk_size=chunk)
    assert out is not None
    return out


def test_config_from_gguf_metadata(ours: tuple[LlamaModel, ByteBPETokenizer]) -> None:
    c = ours[0].config
    assert (c.layers, c.heads, c.kv_heads, c.head_dim, c.hidden, c.vocab) == (30, 9, 3, 64, 576, 49152)
    assert c.tie_embeddings and c.rope_theta == 100000.0
    assert c.fingerprint().startswith("model=SmolLM2-135M-Instruct;rev=gguf-Q4_1;layers=30;kv_heads=3")


def test_weights_match_transformers_gguf_processing(ours: tuple[LlamaModel, ByteBPETokenizer]) -> None:
    """Q/K un-permutation and dequantization against transformers' GGUF tensor processor."""
    pytest.importorskip("transformers")
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from kvstore.model.gguf_loader import find_smollm2_gguf

    model = ours[0]
    c = model.config
    processor = LlamaTensorProcessor(config={"num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads})
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "ffn_down": "mlp.down_proj"}
    state = model.state_dict()
    checked = 0
    for t in GGUFReader(str(find_smollm2_gguf())).tensors:
        if t.name == "token_embd.weight":
            ours_name = "model.embed_tokens.weight"
        elif t.name.startswith("blk."):
            _, layer, kind, _ = t.name.split(".")
            if kind not in names:
                continue
            ours_name = f"model.layers.{layer}.{names[kind]}.weight"
        else:
            continue
        w = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
        assert torch.equal(torch.from_numpy(w.copy()), state[ours_name]), t.name
        checked += 1
    assert checked == 1 + 3 * c.layers


def test_logits_match_transformers(ours: tuple[LlamaModel, ByteBPETokenizer], hf) -> None:
    model, tok = ours
    worst = 0.0
    for i, ids in enumerate(_prompts(tok)):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        got = _prefill(model, ids, chunk=64 if i == 4 else None)  # the long one through chunked prefill
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    assert worst < 1e-4


def test_greedy_generation_matches_transformers(ours: tuple[LlamaModel, ByteBPETokenizer], hf) -> None:
    model, tok = ours
    prompts = {i: tok.encode_chat(c) for i, c in enumerate(CHATS)}
    pool = model.new_pool(64)
    got = greedy_generate(model, pool, prompts, 20, stop_ids=tok.stop_ids)  # all three batched
    for i, ids in prompts.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_id)
        assert got[i] == out[0, len(ids) :].tolist(), tok.decode(got[i])


def test_answers_in_english(ours: tuple[LlamaModel, ByteBPETokenizer]) -> None:
    model, tok = ours
    out = greedy_generate(model, model.new_pool(8), {0: tok.encode_chat(CHATS[0])}, 20, stop_ids=tok.stop_ids)
    assert "Paris" in tok.decode(out[0], skip_special=True)


def test_real_kv_blocks_are_pool_payloads(ours: tuple[LlamaModel, ByteBPETokenizer]) -> None:
    model, tok = ours
    kv = smollm2_kv_blocks(40)  # rounds up to 3 full blocks of 16 tokens
    assert kv.shape == (3, 30, 2, 16, 3, 64) and kv.dtype == torch.bfloat16
    pool = model.new_pool(3)
    pool.add_sequence(0)
    model.prefill(pool, 0, english_tokens(tok, 48), logits="none")
    assert torch.equal(kv, pool.kv[torch.tensor(pool.block_table(0))].to(torch.bfloat16))
    assert torch.equal(smollm2_kv_blocks(40), kv)
    small = smollm2_kv_blocks(24, block_size=8, dtype=torch.float16, seed=2)
    assert small.shape == (3, 30, 2, 8, 3, 64) and small.dtype == torch.float16
    assert bool(small.isfinite().all()) and small.abs().amax() > 0
