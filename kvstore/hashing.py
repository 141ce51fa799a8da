"""Block identity (DESIGN 2.1): chained BLAKE2b-128 prefix hashes.

    root = BLAKE2b-128(b"kvstore/v1\\0" + utf8(namespace) + b"\\0" + utf8(model_fingerprint))
    h[i] = BLAKE2b-128(h[i-1] + tokens[i*B:(i+1)*B] as little-endian uint32),  h[-1] = root

Only full blocks are hashed; the tail is recomputed by the worker. A
cryptographic hash on purpose: with a fast non-cryptographic one a tenant can
craft collisions and poison another tenant's cache. Test vectors for other
clients: tests/data/hash_vectors.json.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from hashlib import blake2b

import numpy as np

HASH_BYTES = 16
_DOMAIN = b"kvstore/v1\0"
MAX_TOKEN_ID = 2**32 - 1


def chain_root(namespace: str, model_fingerprint: str) -> bytes:
    """The h[-1] of every chain in (namespace, model)."""
    seed = _DOMAIN + namespace.encode("utf-8") + b"\0" + model_fingerprint.encode("utf-8")
    return blake2b(seed, digest_size=HASH_BYTES).digest()


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError("token ids must be in [0, 2**32-1]")
    return arr.astype("<u4", copy=False).tobytes()


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    namespace: str,
    model_fingerprint: str,
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of every full block of `tokens`; `parent` continues an existing chain."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    data = _token_bytes(tokens)
    prev = parent if parent is not None else chain_root(namespace, model_fingerprint)
    stride = 4 * block_size
    out: list[bytes] = []
    for start in range(0, len(data) - stride + 1, stride):
        prev = blake2b(prev + data[start : start + stride], digest_size=HASH_BYTES).digest()
        out.append(prev)
    return out


def model_fingerprint(
    *,
    model: str,
    revision: str = "",
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    block_size: int,
    layout: str = "page-first",
    adapter: str = "",
) -> str:
    """Canonical string of everything that changes the bytes of a block."""
    parts: Iterable[tuple[str, object]] = (
        ("model", model),
        ("rev", revision),
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("dtype", dtype),
        ("block", block_size),
        ("layout", layout),
        ("adapter", adapter),
    )
    return ";".join(f"{k}={v}" for k, v in parts)
