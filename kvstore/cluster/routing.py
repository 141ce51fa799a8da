"""Placement by weighted rendezvous (highest random weight) hashing.

``rank(key, nodes)`` orders nodes by ``score(node, key) = weight / -ln(u)`` with
``u`` a uniform number in (0, 1) derived from BLAKE2b(node id, key): the first
node is where a new prefix goes, the rest are the fallbacks in order. Every
client computes the same order from the same member list without talking to
anyone; a node joining or leaving moves only the keys it wins or held (about
1/N of them), and a node gets a share of keys proportional to its weight
(its capacity in bytes).

The key is the *prefix root*: the first block hash of a chain, so all blocks of
a prefix (and every later extension of it) land on the same node and a lookup
finds them together.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

N = TypeVar("N")
_SCALE = float(1 << 64)


def score(node_id: str, key: bytes, weight: float = 1.0) -> float:
    digest = hashlib.blake2b(node_id.encode() + b"\0" + key, digest_size=8, person=b"kvstore-hrw").digest()
    u = (int.from_bytes(digest, "little") + 0.5) / _SCALE  # in (0, 1)
    return max(weight, 1e-12) / -math.log(u)


def _id_of(node: Any) -> str:
    """A node's ``id`` (the default key of ``rank``)."""
    node_id: str = node.id
    return node_id


def rank(
    key: bytes,
    nodes: Sequence[N],
    node_id: Callable[[N], str] = _id_of,
    weight: Callable[[N], float] = lambda n: float(getattr(n, "weight", 1.0)),
) -> list[N]:
    """Nodes in placement order for ``key`` (best first)."""
    return sorted(nodes, key=lambda n: score(node_id(n), key, weight(n)), reverse=True)
