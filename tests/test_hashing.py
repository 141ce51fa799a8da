"""Block identity (DESIGN 2.1) against the shipped test vectors and an independent reading of the spec."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from kvstore.hashing import block_hashes, chain_root

VECTORS = json.loads((Path(__file__).parent / "data" / "hash_vectors.json").read_text())["cases"]


def reference(tokens: list[int], bs: int, ns: str, fp: str) -> list[str]:
    """DESIGN 2.1 written out with nothing but hashlib and struct."""
    h = hashlib.blake2b(b"kvstore/v1\x00" + ns.encode() + b"\x00" + fp.encode(), digest_size=16).digest()
    out = []
    for i in range(len(tokens) // bs):
        h = hashlib.blake2b(h + struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs]), digest_size=16).digest()
        out.append(h.hex())
    return out


def test_at_least_twenty_cases():
    assert len(VECTORS) >= 20
    assert {c["block_size"] for c in VECTORS} >= {1, 16, 256}


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_vectors(case):
    got = block_hashes(case["tokens"], case["block_size"], case["namespace"], case["model_fingerprint"])
    assert [h.hex() for h in got] == case["hashes"]
    assert chain_root(case["namespace"], case["model_fingerprint"]).hex() == case["root"]
    assert case["hashes"] == reference(case["tokens"], case["block_size"], case["namespace"], case["model_fingerprint"])


def test_prefix_sharing_and_isolation():
    a = block_hashes(list(range(64)), 16, "ns", "m")
    b = block_hashes(list(range(48)) + [9] * 16, 16, "ns", "m")
    assert a[:3] == b[:3] and a[3] != b[3]
    assert block_hashes(list(range(16)), 16, "other", "m")[0] != a[0]
    assert block_hashes(list(range(16)), 16, "ns", "m2")[0] != a[0]


def test_continue_chain_with_parent():
    full = block_hashes(list(range(64)), 16, "ns", "m")
    assert block_hashes(list(range(32, 64)), 16, "ns", "m", parent=full[1]) == full[2:]


def test_rejects_out_of_range_tokens():
    with pytest.raises(ValueError):
        block_hashes([2**32], 1, "ns", "m")
    with pytest.raises(ValueError):
        block_hashes([-1], 1, "ns", "m")
