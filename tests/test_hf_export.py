"""``kvstore export-model smollm2 DIR``: transformers loads the directory, and its logits and tokenizer equal the
project's own runtime's (vLLM loading it is covered by tests/test_vllm_connector.py)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    from kvstore.cli import main

    dest = tmp_path_factory.mktemp("hf") / "smollm2"
    try:
        from kvstore.model.gguf_loader import find_smollm2_gguf

        find_smollm2_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    assert main(["export-model", "smollm2", str(dest)]) == 0
    return dest


def test_directory_is_a_llama_checkpoint(exported) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in exported.iterdir()
    }


def test_transformers_matches_our_runtime(exported) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvstore.model import load_model

    torch.set_num_threads(1)
    ours, tok = load_model("smollm2")
    assert tok is not None
    hf_tok = AutoTokenizer.from_pretrained(str(exported))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode_chat(chat)
    got = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    got = list(got["input_ids"] if hasattr(got, "keys") else got)
    assert got == ids
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)

    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    pool = ours.new_pool(len(ids) // 16 + 2)
    pool.add_sequence(0)
    mine = ours.prefill(pool, 0, ids, logits="all")
    assert mine is not None
    assert float((mine - ref).abs().max() / ref.abs().max()) < 1e-4
