"""Tiny random Llama: every path through the paged pool computes the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.hashing import block_hashes, model_fingerprint
from kvstore.model import OutOfBlocks, load_model
from kvstore.model.config import ModelConfig, RopeScaling
from kvstore.model.generate import greedy_generate
from kvstore.model.llama import LlamaModel
from kvstore.model.ops import apply_rope, rms_norm, rope_cos_sin
from kvstore.model.weights import random_state_dict, save_checkpoint_dir

CFG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(CFG, seed=0)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _full(model: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    pool = model.new_pool(64)
    pool.add_sequence("ref")
    out = model.prefill(pool, "ref", tokens, logits="all")
    assert out is not None
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16, 23])
def test_chunked_prefill_equals_full_prefill(model: LlamaModel, chunk: int) -> None:
    toks = _tokens(70)
    ref = _full(model, toks)
    pool = model.new_pool(64)
    pool.add_sequence("s")
    got = model.prefill(pool, "s", toks, logits="all", chunk_size=chunk)
    assert got is not None and got.shape == (70, CFG.vocab)
    assert _rel(got, ref) < 1e-5


def test_step_by_step_decode_equals_full_prefill(model: LlamaModel) -> None:
    toks = _tokens(40, seed=1)
    ref = _full(model, toks)
    pool = model.new_pool(64)
    pool.add_sequence("s")
    first = model.prefill(pool, "s", toks[:1], logits="all")
    rows = [first[0]] + [model.decode(pool, ["s"], [int(t)])[0] for t in toks[1:]]
    assert _rel(torch.stack(rows), ref) < 1e-5


def test_cached_prefix_blocks_are_shared_and_give_the_same_logits(model: LlamaModel) -> None:
    toks = _tokens(53, seed=2)
    ref = _full(model, toks)
    hashes = block_hashes(toks.tolist(), CFG.block_size, "ns", CFG.fingerprint())
    pool = model.new_pool(64)
    pool.add_sequence("a", hashes)
    model.prefill(pool, "a", toks[:40], logits="none")
    assert pool.lookup(hashes) == 2  # blocks 0 and 1 are full, block 2 is not yet
    reused = pool.add_sequence("b", hashes)
    assert reused == 32 and pool.block_table("b") == pool.block_table("a")[:2]
    got = model.prefill(pool, "b", toks[reused:], logits="all")
    assert _rel(got, ref[reused:]) < 1e-5


def test_blocks_moved_as_payload_bytes_continue_the_sequence(model: LlamaModel) -> None:
    """What the prefill worker Puts and the decode worker Gets: raw block bytes."""
    toks = _tokens(60, seed=3)
    ref = _full(model, toks)
    src = model.new_pool(64)
    src.add_sequence("p")
    model.prefill(src, "p", toks[:50], logits="none", chunk_size=16)
    payloads = [bytes(p.numpy()) for p in src.sequence_payloads("p")]
    assert len(payloads) == 3 and all(len(p) == CFG.kv_block_bytes for p in payloads)
    dst = model.new_pool(32)
    dst.add_sequence("d")
    dst.extend_with_payloads("d", payloads)
    got = model.prefill(dst, "d", toks[48:], logits="all")
    assert _rel(got, ref[48:]) < 1e-5


def test_iter_prefill_reports_blocks_as_they_fill(model: LlamaModel) -> None:
    toks = _tokens(45, seed=12)
    pool = model.new_pool(8)
    pool.add_sequence("s")
    chunks = list(model.iter_prefill(pool, "s", toks, 20))
    assert [c.tokens_done for c in chunks] == [20, 40, 45]
    assert [c.full_blocks for c in chunks] == [range(0, 1), range(1, 2), range(2, 2)]
    assert [c.logits is None for c in chunks] == [True, True, False]
    assert _rel(chunks[-1].logits[0], _full(model, toks)[-1]) < 1e-5


def test_batched_decode_of_ragged_sequences_equals_single(model: LlamaModel) -> None:
    lengths = [5, 16, 17, 40]
    prompts = {i: _tokens(n, seed=10 + i) for i, n in enumerate(lengths)}
    nxt = [int(t) for t in _tokens(len(lengths), seed=99)]
    batched = model.new_pool(64)
    for i, p in prompts.items():
        batched.add_sequence(i)
        model.prefill(batched, i, p, logits="none")
    got = model.decode(batched, list(prompts), nxt)
    for i, p in prompts.items():
        pool = model.new_pool(16)
        pool.add_sequence(i)
        model.prefill(pool, i, p, logits="none")
        assert _rel(got[i], model.decode(pool, [i], [nxt[i]])[0]) < 1e-5


def test_mixed_prefill_and_decode_in_one_step(model: LlamaModel) -> None:
    a, b = _tokens(30, seed=4), _tokens(25, seed=5)
    ref_a, ref_b = _full(model, a), _full(model, b)
    pool = model.new_pool(64)
    pool.add_sequence("a")
    pool.add_sequence("b")
    model.prefill(pool, "a", a[:29], logits="none")
    model.prefill(pool, "b", b[:10], logits="none")
    out = model.forward(pool, [("a", a[29:]), ("b", b[10:])], logits="all")
    assert out is not None and out.shape == (1 + 15, CFG.vocab)
    assert _rel(out[0], ref_a[29]) < 1e-5 and _rel(out[1:], ref_b[10:]) < 1e-5


def test_fork_with_partial_block_copies_on_write(model: LlamaModel) -> None:
    prompt = _tokens(21, seed=6).tolist()
    pool = model.new_pool(64)
    pool.add_sequence("p")
    model.prefill(pool, "p", prompt, logits="none")
    pool.fork("p", "q")
    outs = {}
    for sid, tok in (("p", 7), ("q", 8)):
        outs[sid] = greedy_generate(model, pool, {sid: prompt + [tok]}, 12)[sid]
    assert pool.block_table("p")[1] != pool.block_table("q")[1]  # diverged at the partial block
    for tok, sid in ((7, "p"), (8, "q")):
        alone = model.new_pool(16)
        assert greedy_generate(model, alone, {"x": prompt + [tok]}, 12)["x"] == outs[sid]


def test_greedy_generation_batched_equals_one_at_a_time(model: LlamaModel) -> None:
    prompts = {i: _tokens(n, seed=20 + i).tolist() for i, n in enumerate([3, 18, 33])}
    pool = model.new_pool(64)
    together = greedy_generate(model, pool, prompts, 15, chunk_size=8)
    for i, p in prompts.items():
        alone = greedy_generate(model, model.new_pool(16), {i: p}, 15)
        assert alone[i] == together[i] and len(alone[i]) == 15


def test_pool_holds_post_rope_k_and_v_of_each_token(model: LlamaModel) -> None:
    toks = _tokens(20, seed=7)
    pool = model.new_pool(8)
    pool.add_sequence("s")
    model.prefill(pool, "s", toks, logits="none")
    sd = model.state_dict()
    h = rms_norm(sd["model.embed_tokens.weight"][toks], sd["model.layers.0.input_layernorm.weight"], CFG.rms_eps)
    k = (h @ sd["model.layers.0.self_attn.k_proj.weight"].T).reshape(20, CFG.kv_heads, CFG.head_dim)
    v = (h @ sd["model.layers.0.self_attn.v_proj.weight"].T).reshape(20, CFG.kv_heads, CFG.head_dim)
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(20), torch.float32)
    k = apply_rope(k, cos, sin)
    table = pool.block_table("s")
    for t in range(20):
        block = pool.kv[table[t // 16]]  # [layers, 2, block, kv_heads, head_dim]
        torch.testing.assert_close(block[0, 0, t % 16], k[t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block[0, 1, t % 16], v[t], rtol=1e-5, atol=1e-5)


def test_out_of_blocks_leaves_the_pool_unchanged(model: LlamaModel) -> None:
    pool = model.new_pool(3)
    pool.add_sequence("a")
    pool.add_sequence("b")
    model.prefill(pool, "a", _tokens(20), logits="none")  # 2 blocks
    before = (pool.block_table("a"), pool.num_tokens("a"), pool.num_free_blocks)
    with pytest.raises(OutOfBlocks):
        model.forward(pool, [("a", _tokens(1)), ("b", _tokens(20))])
    assert before == (pool.block_table("a"), pool.num_tokens("a"), pool.num_free_blocks)
    assert pool.num_tokens("b") == 0


def test_random_init_is_seeded_and_fingerprinted() -> None:
    a, b, c = random_state_dict(CFG, 0), random_state_dict(CFG, 0), random_state_dict(CFG, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert ModelConfig.tiny(seed=0).fingerprint() != ModelConfig.tiny(seed=1).fingerprint()
    assert CFG.fingerprint() == model_fingerprint(
        model="random-tiny",
        revision="seed0",
        layers=2,
        kv_heads=2,
        head_dim=16,
        dtype="float32",
        block_size=16,
    )


def test_bench_preset_has_megabyte_blocks() -> None:
    cfg = ModelConfig.bench()
    assert cfg.dtype == "bfloat16" and cfg.kv_block_bytes == 1 << 20


def test_bfloat16_model_tracks_float32(model: LlamaModel) -> None:
    bf = LlamaModel(CFG.with_(dtype="bfloat16"), model.state_dict())
    toks = _tokens(30, seed=8)
    pool = bf.new_pool(8)
    assert pool.kv.dtype == torch.bfloat16
    pool.add_sequence("s")
    got = bf.prefill(pool, "s", toks, logits="all")
    assert got is not None and got.dtype == torch.float32
    assert _rel(got, _full(model, toks)) < 0.05


def test_safetensors_checkpoint_round_trip(model: LlamaModel, tmp_path: Path) -> None:
    save_checkpoint_dir(CFG, model.state_dict(), tmp_path / "ckpt")
    loaded, tokenizer = load_model(str(tmp_path / "ckpt"))
    assert tokenizer is None and loaded.config == CFG
    toks = _tokens(20, seed=9)
    assert torch.equal(_full(loaded, toks), _full(model, toks))


def test_load_model_presets_and_errors() -> None:
    tiny, tok = load_model("tiny")
    assert tok is None and tiny.config == CFG
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")


# -- against Hugging Face transformers ------------------------------------------------------------
def _hf_logits(cfg: ModelConfig, state: dict[str, torch.Tensor], toks: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.to_hf_config().items() if not k.startswith("_")})
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(state, strict=not cfg.tie_embeddings)
    with torch.no_grad():
        return hf(toks[None]).logits[0].float()


@pytest.mark.parametrize("variant", ["tied", "untied", "llama3-rope", "linear-rope"])
def test_tiny_logits_match_transformers(variant: str) -> None:
    cfg = {
        "tied": CFG,
        "untied": CFG.with_(tie_embeddings=False),
        "llama3-rope": CFG.with_(rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
        "linear-rope": CFG.with_(rope_scaling=RopeScaling("linear", 2.0)),
    }[variant]
    state = random_state_dict(cfg, seed=3)
    toks = _tokens(90, seed=11)
    ref = _hf_logits(cfg, state, toks)
    got = _full(LlamaModel(cfg, state), toks)
    assert _rel(got, ref) < 1e-5
