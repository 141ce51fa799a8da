"""Partial loads: Get a prefix of blocks and keep the leading ones that arrived intact.

``get_leading(client, namespace, hashes, out, piece_blocks=...) -> Leading``
fetches ``hashes`` into the caller's buffers ``out`` in pieces of
``piece_blocks`` (one public ``Client.get`` each, CRC32C checked by the
client), in order, and stops at the first block that did not arrive intact:

- a missing block (``allow_missing``: None in its place): the blocks before it count;
- a CRC mismatch or an unreadable block (DATA_LOSS, NOT_FOUND, ...): the
  failed piece is fetched again block by block to find the first bad one; the
  blocks before it count;
- the node gone or the lane broken mid-Get (UNAVAILABLE, DEADLINE_EXCEEDED,
  ...): the pieces that completed count; the failed piece does not (its
  buffers may hold a torn transfer).

Promise: ``Leading.blocks`` leading buffers hold complete, checksum-verified
blocks; nothing after them is ever counted, even if it arrived. What is in the
other buffers is undefined. A client that offered "a Get that returns the
intact leading blocks when a later one fails" (the count, per-block status)
would make the pieces and the re-fetch of a failed piece unnecessary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.errors import KVStoreError

# Errors that concern a block (its bytes or its presence), not the node or the connection.
BLOCK_ERRORS = frozenset(
    {grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL}
)


@dataclass
class Leading:
    blocks: int  # leading blocks that arrived intact
    requested: int
    calls: int
    seconds: float
    failure: str = ""  # why the blocks after ``blocks`` are not used; "" when all arrived


def get_leading(
    client: Any,
    namespace: str,
    hashes: Sequence[bytes],
    out: Sequence[Any],
    *,
    piece_blocks: int,
    on_piece: Callable[[int], None] | None = None,
) -> Leading:
    """See the module docstring. ``on_piece(blocks_done)`` runs after each complete piece (tests, progress)."""
    if len(out) != len(hashes):
        raise ValueError(f"{len(hashes)} hashes but {len(out)} output buffers")
    t0 = time.perf_counter()
    total, step = len(hashes), max(piece_blocks, 1)
    done = calls = 0
    failure = ""
    while done < total and not failure:
        stop = min(done + step, total)
        calls += 1
        try:
            got = client.get(namespace, hashes[done:stop], out=out[done:stop], allow_missing=True)
        except KVStoreError as err:
            if err.code not in BLOCK_ERRORS:
                failure = f"blocks {done}-{stop - 1}: {err}"
                break
            done, calls_made, failure = _first_bad(client, namespace, hashes, out, done, stop)
            calls += calls_made
            continue  # all of the piece arrived intact one by one (a transient error): go on
        except ValueError as err:  # a buffer the block does not fit: the caller's mistake, but never use it
            failure = f"blocks {done}-{stop - 1}: {err}"
            break
        missing = next((i for i, block in enumerate(got) if block is None), None)
        if missing is not None:
            done += missing
            failure = f"block {done} is missing"
            break
        done = stop
        if on_piece is not None:
            on_piece(done)
    return Leading(done, total, calls, time.perf_counter() - t0, failure)


def _first_bad(
    client: Any, namespace: str, hashes: Sequence[bytes], out: Sequence[Any], start: int, stop: int
) -> tuple[int, int, str]:
    """Fetch ``[start, stop)`` block by block up to the first one that fails: (good end, calls, why)."""
    calls = 0
    for i in range(start, stop):
        calls += 1
        try:
            got = client.get(namespace, [hashes[i]], out=[out[i]], allow_missing=True)
        except (KVStoreError, ValueError) as err:
            return i, calls, f"block {i}: {err}"
        if got[0] is None:
            return i, calls, f"block {i} is missing"
    return stop, calls, ""
