"""Block tables: which physical blocks hold each sequence's tokens (pure logic).

A sequence's token ``t`` lives in block ``table[t // block_size]`` at slot
``t % block_size``. Blocks are reference-counted (``allocator.BlockAllocator``)
so sequences share them. Verbs and their promises:

- ``add(seq, hashes) -> reused_tokens``: start a sequence. ``hashes`` are the
  chain hashes (DESIGN 2.1) of its prompt's full blocks; the longest run of
  leading hashes whose blocks are live in the pool is shared, not copied.
- ``fork(parent, child)``: the child shares every block of the parent,
  including a partially filled last block (parallel sampling, beam search).
- ``append(seq, n) -> AppendPlan``: room for n more tokens. Blocks are
  allocated on demand; if the last block is partially filled and shared, it
  is first copied (copy-on-write): the plan lists the copies to perform
  before writing, and no slot in the plan belongs to a block another
  sequence can see. All or nothing: ``OutOfBlocks`` leaves state unchanged.
- ``extend_full(seq, n) -> ids``: n fresh full blocks appended (for payloads
  fetched from the store); the caller fills them before any other call.
- ``reserve(n) -> ids`` / ``attach_full(seq, ids)`` / ``release(ids)``: blocks
  held by the caller outside any sequence (a load filling them while the
  sequence computes its earlier blocks), then appended to a sequence as full
  blocks (it must end at a block boundary) or given back.
- ``add_hashes(seq, hashes)``: more chain hashes for the sequence (e.g. of
  generated tokens). A full block with a known hash is published so later
  sequences can share it; the first block published under a hash wins.
- ``free(seq) -> freed ids``: drop the sequence; blocks no one else holds go
  back to the free list and leave the prefix index.
- ``lookup(hashes) -> int``: how many leading hashes are live in the pool.

Publishing happens when a block becomes full in the plan, before its K/V is
written: callers must write the planned slots before starting or extending
another sequence (the model runtime does both inside one forward call).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvstore.model.allocator import BlockAllocator, OutOfBlocks

SeqId = Hashable


@dataclass
class SequenceState:
    """One sequence's block table and counters."""

    table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)
    published: int = 0  # leading full blocks already offered to the prefix index


@dataclass(frozen=True)
class AppendPlan:
    """Where n new tokens go: ``blocks[i]``/``offsets[i]`` for token ``start + i``."""

    start: int
    blocks: list[int]
    offsets: list[int]
    copies: list[tuple[int, int]]  # (src, dst) whole-block copies to do first


class BlockManager:
    """Per-sequence block tables over a reference-counted allocator."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self._seqs: dict[SeqId, SequenceState] = {}
        self._index: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}

    # -- queries ------------------------------------------------------------------
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def sequences(self) -> list[SeqId]:
        return list(self._seqs)

    def state(self, seq_id: SeqId) -> SequenceState:
        """The live state of a sequence (read it, do not mutate it)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def table(self, seq_id: SeqId) -> list[int]:
        return list(self.state(seq_id).table)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.state(seq_id).num_tokens

    def lookup(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self._index:
                break
            n += 1
        return n

    def indexed_block(self, h: bytes) -> int | None:
        return self._index.get(h)

    def blocks_needed(self, seq_id: SeqId, n: int) -> int:
        """Free blocks ``append(seq_id, n)`` would take (new ones plus a copy-on-write)."""
        new_blocks, cow = self._growth(self.state(seq_id), n)
        return new_blocks + cow

    # -- verbs --------------------------------------------------------------------
    def add(self, seq_id: SeqId, hashes: Sequence[bytes] = ()) -> int:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        state = SequenceState(hashes=list(hashes))
        for h in state.hashes:
            b = self._index.get(h)
            if b is None:
                break
            self.allocator.incref(b)
            state.table.append(b)
        state.num_tokens = len(state.table) * self.block_size
        state.published = len(state.table)
        self._seqs[seq_id] = state
        return state.num_tokens

    def fork(self, parent: SeqId, child: SeqId) -> None:
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already exists")
        src = self.state(parent)
        for b in src.table:
            self.allocator.incref(b)
        self._seqs[child] = SequenceState(
            table=list(src.table),
            num_tokens=src.num_tokens,
            hashes=list(src.hashes),
            published=src.published,
        )

    def append(self, seq_id: SeqId, n: int) -> AppendPlan:
        if n < 0:
            raise ValueError("n must be >= 0")
        state = self.state(seq_id)
        bs = self.block_size
        start = state.num_tokens
        new_blocks, cow = self._growth(state, n)
        if new_blocks + cow > self.allocator.num_free:
            raise OutOfBlocks(new_blocks + cow, self.allocator.num_free)
        copies: list[tuple[int, int]] = []
        if cow:
            (dst,) = self.allocator.allocate(1)
            src = state.table[-1]
            self.allocator.decref(src)  # still held by another sequence: never freed here
            state.table[-1] = dst
            copies.append((src, dst))
        state.table.extend(self.allocator.allocate(new_blocks))
        positions = range(start, start + n)
        plan = AppendPlan(
            start=start,
            blocks=[state.table[p // bs] for p in positions],
            offsets=[p % bs for p in positions],
            copies=copies,
        )
        state.num_tokens = start + n
        self._publish(state)
        return plan

    def extend_full(self, seq_id: SeqId, n: int) -> list[int]:
        state = self.state(seq_id)
        if state.num_tokens % self.block_size:
            raise ValueError(
                f"sequence {seq_id!r} ends inside a block ({state.num_tokens} tokens): "
                "full blocks can only follow full blocks"
            )
        ids = self.allocator.allocate(n)
        state.table.extend(ids)
        state.num_tokens += n * self.block_size
        self._publish(state)
        return ids

    def reserve(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def attach_full(self, seq_id: SeqId, ids: Sequence[int]) -> None:
        state = self.state(seq_id)
        if state.num_tokens % self.block_size:
            raise ValueError(f"sequence {seq_id!r} ends inside a block ({state.num_tokens} tokens)")
        state.table.extend(ids)
        state.num_tokens += len(ids) * self.block_size
        self._publish(state)

    def release(self, ids: Sequence[int]) -> None:
        self.allocator.decref_all(ids)

    def add_hashes(self, seq_id: SeqId, hashes: Sequence[bytes]) -> None:
        state = self.state(seq_id)
        state.hashes.extend(hashes)
        self._publish(state)

    def free(self, seq_id: SeqId) -> list[int]:
        state = self._seqs.pop(seq_id, None)
        if state is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        freed = self.allocator.decref_all(state.table)
        for b in freed:
            h = self._block_hash.pop(b, None)
            if h is not None and self._index.get(h) == b:
                del self._index[h]
        return freed

    # -- internals ----------------------------------------------------------------
    def _growth(self, state: SequenceState, n: int) -> tuple[int, bool]:
        """(new blocks, copy-on-write of the last block?) for appending n tokens."""
        start = state.num_tokens
        cow = n > 0 and start % self.block_size != 0 and self.allocator.refcount(state.table[-1]) > 1
        return -(-(start + n) // self.block_size) - len(state.table), cow

    def _publish(self, state: SequenceState) -> None:
        limit = min(state.num_tokens // self.block_size, len(state.hashes))
        for i in range(state.published, limit):
            h, b = state.hashes[i], state.table[i]
            if h not in self._index and b not in self._block_hash:
                self._index[h] = b
                self._block_hash[b] = h
        state.published = max(state.published, limit)
