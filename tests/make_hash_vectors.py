"""Regenerate tests/data/hash_vectors.json: `python tests/make_hash_vectors.py`.

The cases are fixed here; the digests come from kvstore.hashing and are then
checked by tests/test_hashing.py against an independent reading of DESIGN 2.1.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.hashing import block_hashes, chain_root

FP = "model=SmolLM2-135M-Instruct;rev=;layers=30;kv_heads=3;head_dim=64;dtype=bfloat16;block=16;layout=page-first;adapter="
CASES = [
    ("empty namespace", "", FP, 16, list(range(32))),
    ("default", "default", FP, 16, list(range(48))),
    ("tail is not hashed", "default", FP, 16, list(range(40))),
    ("shorter than a block", "default", FP, 16, list(range(15))),
    ("no tokens", "default", FP, 16, []),
    ("block size 1", "default", FP, 1, [1, 2, 3, 4, 5]),
    ("block size 256", "default", FP, 256, [i % 50000 for i in range(512)]),
    ("block size 256 with tail", "t", FP, 256, [7] * 300),
    ("token ids near 2^32-1", "default", FP, 4, [2**32 - 1, 2**32 - 2, 2**32 - 3, 0, 2**31, 2**32 - 1, 1, 2]),
    ("max token everywhere", "max", FP, 16, [2**32 - 1] * 32),
    ("unicode namespace", "tenant-é-日本語-🙂", FP, 16, list(range(16))),
    ("long namespace", "n" * 200, FP, 16, list(range(16))),
    ("namespace with cache salt", "tenant-a/salt-9f2c", FP, 16, list(range(16))),
    ("other tenant same tokens", "tenant-b/salt-01aa", FP, 16, list(range(16))),
    ("empty fingerprint", "default", "", 16, list(range(16))),
    ("unicode fingerprint", "default", "modèle=λ", 16, list(range(16))),
    ("fp16 model", "default", FP.replace("bfloat16", "float16"), 16, list(range(32))),
    ("lora adapter", "default", FP + "lora-7", 16, list(range(32))),
    ("block size 8", "default", FP, 8, list(range(100, 164))),
    ("block size 32", "default", FP, 32, [3] * 96),
    ("block size 2 zeros", "default", FP, 2, [0] * 6),
    ("large vocab ids", "default", FP, 16, [151_000 + i for i in range(32)]),
]


def main() -> None:
    rows = []
    for name, ns, fp, bs, tokens in CASES:
        rows.append(
            {
                "name": name,
                "namespace": ns,
                "model_fingerprint": fp,
                "block_size": bs,
                "tokens": tokens,
                "root": chain_root(ns, fp).hex(),
                "hashes": [h.hex() for h in block_hashes(tokens, bs, ns, fp)],
            }
        )
    out = Path(__file__).parent / "data" / "hash_vectors.json"
    out.write_text(
        json.dumps({"spec": "DESIGN.md 2.1 (kvstore/v1)", "cases": rows}, indent=1, ensure_ascii=False) + "\n"
    )
    print(f"wrote {len(rows)} cases to {out}")


if __name__ == "__main__":
    main()
