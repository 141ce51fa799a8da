"""`kvstore demo --engine vllm`: disaggregated serving on two real vLLM engines over `kvstore serve`.

Starts `kvstore serve` (DRAM tier), a prefill engine (`kv_producer`) and a decode engine (`kv_consumer`), each
vLLM with `KVStoreConnector` in a process of its own, on SmolLM2-135M-Instruct exported from the bundled GGUF
(`kvstore export-model`; nothing is downloaded). A multi-turn chat runs over a long shared system prompt. Each
turn:

1. the prefill engine reads the prompt and its connector saves the full KV blocks to the store;
2. the decode engine, with its own prefix cache emptied, loads the longest stored prefix from the store and
   computes only the rest: time to first token *with the store*;
3. the decode engine recomputes the same prompt under another `cache_salt` (no hit anywhere): time to first
   token *without the store*;
4. both generate the answer greedily; the tokens must be equal.

It prints both times to first token, the blocks and bytes the decode engine loaded and at what bandwidth, and
the answer. Exit status 1 when tokens differ.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.chat_script import SYSTEM, TURNS

BLOCK = 32  # vLLM's CPU backend wants a multiple of 32


@dataclass
class TurnResult:
    prompt_tokens: int
    ttft_store_s: float
    ttft_recompute_s: float
    cached_tokens: int
    loaded_blocks: int
    loaded_bytes: int
    load_s: float
    same_tokens: bool
    answer: str


def chat(model_dir: Path, work: Path, new_tokens: int, system_repeat: int) -> list[TurnResult]:
    from transformers import AutoTokenizer

    from kvstore.integrations.vllm_engine import EngineProcess, EngineSpec
    from kvstore.server.process import store_process

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    results: list[TurnResult] = []
    print("starting kvstore serve, a prefill engine (kv_producer) and a decode engine (kv_consumer) ...", flush=True)
    with store_process("--dram", "2GiB") as (target, _):
        common: dict[str, Any] = {"target": target, "namespace": "demo"}
        with (
            EngineProcess(
                EngineSpec(str(model_dir), "kvstore", "kv_producer", {**common, "stats_path": str(work / "p")})
            ) as prefill,
            EngineProcess(
                EngineSpec(str(model_dir), "kvstore", "kv_consumer", {**common, "stats_path": str(work / "d")}, mp=True)
            ) as decode,
        ):
            print(f"engines up ({prefill.start_seconds:.0f} s and {decode.start_seconds:.0f} s)", flush=True)
            history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM * system_repeat}]
            for i, question in enumerate(TURNS, 1):
                history.append({"role": "user", "content": question})
                text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
                ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
                prefill.generate([ids], max_tokens=1)  # computes the prompt; the connector saves its blocks
                prefill.wait_saves()
                before = decode.worker_stats()
                decode.reset_prefix_cache()  # from here on only the store can supply the prefix
                hit = decode.generate([ids], max_tokens=1)
                after = decode.worker_stats()
                cold = decode.generate([ids], max_tokens=1, cache_salt=f"recompute-{i}")
                with_store = decode.generate([ids], max_tokens=new_tokens)["outputs"][0]["tokens"]
                recomputed = decode.generate([ids], max_tokens=new_tokens, cache_salt=f"recompute-{i}")
                recomputed_tokens = recomputed["outputs"][0]["tokens"]
                answer = tokenizer.decode(with_store).split("<|im_end|>")[0].strip()  # the turn ends there
                results.append(
                    TurnResult(
                        prompt_tokens=len(ids),
                        ttft_store_s=hit["seconds"],
                        ttft_recompute_s=cold["seconds"],
                        cached_tokens=hit["outputs"][0]["cached"],
                        loaded_blocks=after.get("load_blocks", 0) - before.get("load_blocks", 0),
                        loaded_bytes=after.get("load_bytes", 0) - before.get("load_bytes", 0),
                        load_s=after.get("load_seconds", 0.0) - before.get("load_seconds", 0.0),
                        same_tokens=with_store == recomputed_tokens,
                        answer=answer,
                    )
                )
                _print_turn(i, question, results[-1], after.get("lane", "?"))
                history.append({"role": "assistant", "content": answer})
    return results


def _print_turn(i: int, question: str, r: TurnResult, lane: str) -> None:
    mb = r.loaded_bytes / 1e6
    gbps = r.loaded_bytes / r.load_s / 1e9 if r.load_s > 0 else 0.0
    print(f"\nturn {i}: {question}\n  prompt {r.prompt_tokens} tokens")
    print(f"  TTFT without the store (decode engine recomputes): {r.ttft_recompute_s * 1e3:8.1f} ms")
    print(
        f"  TTFT with the store (prefill engine -> store -> decode engine): {r.ttft_store_s * 1e3:8.1f} ms "
        f"({r.ttft_recompute_s / max(r.ttft_store_s, 1e-9):.1f}x faster)"
    )
    print(
        f"  loaded {r.loaded_blocks} blocks ({r.cached_tokens} of {r.prompt_tokens} tokens cached), {mb:.1f} MB "
        f"in {r.load_s * 1e3:.1f} ms = {gbps:.2f} GB/s over the {lane} lane"
    )
    print(f"  same tokens as recomputing: {r.same_tokens}")
    print(f"  assistant: {r.answer}")


def main(new_tokens: int = 40, system_repeat: int = 12) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed: `make run` installs it (extra `vllm`), or use --engine builtin", file=sys.stderr)
        return 2
    from kvstore.model.hf_export import exported_smollm2

    model_dir = exported_smollm2()
    print(f"model: SmolLM2-135M-Instruct as a Hugging Face directory at {model_dir}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the engines and the store stop with us
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        results = chat(model_dir, Path(tmp), new_tokens, system_repeat)
    if not results:
        return 1
    total = sum(r.loaded_bytes for r in results)
    print(
        f"\n{len(results)} turns: TTFT p50 with the store "
        f"{sorted(r.ttft_store_s for r in results)[len(results) // 2] * 1e3:.1f} ms, without "
        f"{sorted(r.ttft_recompute_s for r in results)[len(results) // 2] * 1e3:.1f} ms; {total / 1e6:.1f} MB loaded"
    )
    return 0 if all(r.same_tokens for r in results) else 1


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore demo --engine vllm", description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--system-repeat", type=int, default=12)
    args = parser.parse_args(argv)
    return main(args.new_tokens, args.system_repeat)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
