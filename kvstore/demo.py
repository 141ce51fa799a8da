"""`kvstore demo`: start a store on the embedded default and move a batch of KV blocks.

Starts `kvstore serve` (DRAM tier only, loopback), puts a prefix of KV blocks
laid out as DESIGN 2.2 describes (SmolLM2-135M shape: 30 layers, K and V,
16 tokens, 3 KV heads, head dim 64, bf16: 360 KiB a block), looks the prefix
up, gets it back byte-exact and prints throughput. With --workers it runs the
prefill -> store -> decode demo instead (needs the `model` extra).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kvstore.hashing import block_hashes, model_fingerprint


def store_demo(blocks: int, rounds: int) -> int:
    from kvstore.server.process import store_process
    from kvstore.client import Client

    fp = model_fingerprint(model="SmolLM2-135M-Instruct", layers=30, kv_heads=3, head_dim=64, dtype="bfloat16",
                           block_size=16)
    block_bytes = 30 * 2 * 16 * 3 * 64 * 2
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, size=16 * blocks)
    keys = block_hashes(tokens, 16, "demo", fp)
    payloads = [rng.integers(0, 256, size=block_bytes, dtype=np.uint8) for _ in keys]
    print(f"starting kvstore serve (DRAM 1GiB) and moving {blocks} blocks of {block_bytes >> 10} KiB "
          f"({blocks * block_bytes / 1e6:.0f} MB) x {rounds} rounds")
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
            print(f"round {r + 1}: put {total / (t1 - t0) / 1e9:.2f} GB/s ({sum(x.status == 'stored' for x in results)} "
                  f"stored), lookup {cached}/{blocks + 1} blocks cached in {(t2 - t1) * 1e3:.1f} ms, "
                  f"get {total / (t3 - t2) / 1e9:.2f} GB/s, byte-exact: {exact}")
            if not exact:
                return 1
        stats = kv.stats()
    tier = stats["tiers"][0]
    print(f"store: {stats['blocks']} blocks, DRAM {tier['used_bytes'] / 2**20:.0f} of {tier['capacity_bytes'] / 2**20:.0f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256, help="blocks in the prefix (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="repetitions (default: %(default)s)")
    args = parser.parse_args([a for a in (argv or []) if a != "--"])
    return store_demo(args.blocks, args.rounds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
