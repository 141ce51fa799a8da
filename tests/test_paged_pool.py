"""Paged KV pool: allocator and block-table properties (hypothesis), tensor layout and payload I/O."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.hashing import block_hashes
from kvstore.hugepages import HUGE_PAGE
from kvstore.model.allocator import BlockAllocator, OutOfBlocks
from kvstore.model.block_manager import BlockManager
from kvstore.model.config import ModelConfig
from kvstore.model.paged import PagedKVPool
from tests.test_hugepages import fallbacks, huge_kib, skip_if_the_kernel_ran_short, thp_on

SETTINGS = settings(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BS = 4
NUM_BLOCKS = 20


# -- allocator ------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5)), max_size=80))
def test_allocator_matches_a_refcount_model(ops: list[tuple[str, int]]) -> None:
    alloc = BlockAllocator(8)
    refs: dict[int, int] = {}
    for op, arg in ops:
        if op == "alloc":
            n = arg % 4
            if n > 8 - len(refs):
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(n)
                continue
            got = alloc.allocate(n)
            assert len(set(got)) == n and not set(got) & set(refs), "double allocation"
            refs.update({b: 1 for b in got})
        elif refs:
            b = sorted(refs)[arg % len(refs)]
            if op == "incref":
                alloc.incref(b)
                refs[b] += 1
            else:
                freed = alloc.decref(b)
                refs[b] -= 1
                assert freed == (refs[b] == 0)
                if refs[b] == 0:
                    del refs[b]
        free = alloc.free_ids()
        assert len(free) == len(set(free)) == alloc.num_free
        assert alloc.num_free + alloc.num_used == 8
        assert set(free) | set(refs) == set(range(8)) and not set(free) & set(refs)
        assert all(alloc.refcount(b) == r for b, r in refs.items())


def test_allocator_rejects_bad_refcounts() -> None:
    alloc = BlockAllocator(2)
    with pytest.raises(ValueError):
        alloc.decref(0)
    with pytest.raises(ValueError):
        alloc.incref(1)
    assert alloc.allocate(2) == [0, 1]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


# -- block manager ------------------------------------------------------------------------------
class BlockTableMachine(RuleBasedStateMachine):
    """Tracks the token each slot must hold; the manager must never let sequences disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = BlockManager(NUM_BLOCKS, BS)
        self.tokens: dict[int, list[int]] = {}  # what each sequence has written
        self.pending: dict[int, list[int]] = {}  # the rest of its prompt (hashes known)
        self.storage: dict[int, list[int | None]] = {}
        self.next_id = 0

    def _others_blocks(self, sid: int) -> set[int]:
        return {b for s in self.tokens if s != sid for b in self.mgr.state(s).table}

    def _write(self, block: int, offset: int, token: int) -> None:
        self.storage.setdefault(block, [None] * BS)[offset] = token

    @initialize()
    def a_finished_prompt(self) -> None:
        """Sequence 0 holds a fully written prompt, so later prompts of zeros share its blocks."""
        self.add([0] * 12)
        self.mgr.append(0, 12)
        for i in range(12):
            self._write(self.mgr.table(0)[i // BS], i % BS, 0)
        self.tokens[0], self.pending[0] = [0] * 12, []

    PROMPTS = st.one_of(
        st.lists(st.integers(0, 2), max_size=18),
        st.builds(lambda k, tail: [0] * k + tail, st.integers(1, 14), st.lists(st.integers(0, 2), max_size=6)),
    )

    @rule(prompt=PROMPTS)
    def add(self, prompt: list[int]) -> None:
        sid = self.next_id
        self.next_id += 1
        reused = self.mgr.add(sid, block_hashes(prompt, BS, "ns", "fp"))
        assert reused % BS == 0 and reused <= len(prompt)
        if reused:
            event("prefix shared")
        self.tokens[sid], self.pending[sid] = prompt[:reused], prompt[reused:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.tokens[child], self.pending[child] = list(self.tokens[parent]), list(self.pending[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 9))
    def append(self, data: st.DataObject, n: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        new = self.pending[sid][:n]
        new += data.draw(st.lists(st.integers(0, 2), min_size=n - len(new), max_size=n - len(new)))
        others = self._others_blocks(sid)
        seen = {b: list(self.storage.get(b, [])) for b in others}
        before = (self.mgr.table(sid), self.mgr.num_tokens(sid), self.mgr.allocator.num_free)
        try:
            plan = self.mgr.append(sid, n)
        except OutOfBlocks:
            event("out of blocks")
            assert before == (self.mgr.table(sid), self.mgr.num_tokens(sid), self.mgr.allocator.num_free)
            return
        for src, dst in plan.copies:
            event("copy-on-write")
            assert dst not in others
            self.storage[dst] = list(self.storage[src])
        for b, off, tok in zip(plan.blocks, plan.offsets, new):
            assert b not in others, "a write landed in a block another sequence sees"
            self._write(b, off, tok)
        assert seen == {b: list(self.storage.get(b, [])) for b in others}
        self.tokens[sid] += new
        self.pending[sid] = self.pending[sid][n:]

    @precondition(lambda self: any(len(p) >= BS for p in self.pending.values()))
    @rule(data=st.data())
    def extend_full(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(s for s, p in self.pending.items() if len(p) >= BS)))
        if self.mgr.num_tokens(sid) % BS:
            with pytest.raises(ValueError):
                self.mgr.extend_full(sid, 1)
            return
        k = data.draw(st.integers(1, len(self.pending[sid]) // BS))
        try:
            ids = self.mgr.extend_full(sid, k)
        except OutOfBlocks:
            return
        payload = self.pending[sid][: k * BS]
        for i, b in enumerate(ids):  # "load" the fetched payloads
            for off in range(BS):
                self._write(b, off, payload[i * BS + off])
        self.tokens[sid] += payload
        self.pending[sid] = self.pending[sid][k * BS :]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def publish_generated(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.pending[sid]:
            return  # hashes of the prompt are still ahead of what was written
        known = len(self.mgr.state(sid).hashes)
        self.mgr.add_hashes(sid, block_hashes(self.tokens[sid], BS, "ns", "fp")[known:])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(sid)
        del self.tokens[sid], self.pending[sid]

    @invariant()
    def accounting(self) -> None:
        alloc = self.mgr.allocator
        free = alloc.free_ids()
        assert len(free) == len(set(free))
        assert alloc.num_free + alloc.num_used == NUM_BLOCKS
        holders: dict[int, int] = {}
        for sid in self.tokens:
            for b in self.mgr.state(sid).table:
                holders[b] = holders.get(b, 0) + 1
        assert all(alloc.refcount(b) == holders.get(b, 0) for b in range(NUM_BLOCKS))
        assert set(free) == set(range(NUM_BLOCKS)) - set(holders)

    @invariant()
    def contents(self) -> None:
        for sid, toks in self.tokens.items():
            st_ = self.mgr.state(sid)
            assert st_.num_tokens == len(toks)
            assert len(st_.table) == -(-len(toks) // BS)
            read = [self.storage[st_.table[i // BS]][i % BS] for i in range(len(toks))]
            assert read == toks

    @invariant()
    def index_points_at_live_blocks(self) -> None:
        for h, b in self.mgr._index.items():
            assert self.mgr.allocator.refcount(b) > 0
            assert self.mgr._block_hash[b] == h


TestBlockTables = BlockTableMachine.TestCase
TestBlockTables.settings = settings(SETTINGS, max_examples=150, stateful_step_count=40)


def test_prefix_sharing_and_cow_by_example() -> None:
    mgr = BlockManager(8, BS)
    prompt = list(range(10))
    hashes = block_hashes(prompt, BS, "ns", "fp")
    mgr.add("a", hashes)
    plan = mgr.append("a", 10)
    assert plan.copies == [] and mgr.table("a") == [0, 1, 2]
    assert mgr.lookup(hashes) == 2
    assert mgr.add("b", hashes) == 8  # the two full blocks are shared
    assert mgr.table("b") == [0, 1] and mgr.allocator.refcount(0) == 2
    mgr.fork("a", "c")  # shares the partial block 2
    plan = mgr.append("c", 1)
    assert plan.copies == [(2, 3)] and mgr.table("c") == [0, 1, 3]
    assert mgr.append("a", 1).copies == []  # sole holder again: writes in place
    mgr.free("a")
    assert mgr.lookup(hashes) == 2  # still held by b and c
    mgr.free("b")
    mgr.free("c")
    assert mgr.lookup(hashes) == 0 and mgr.allocator.num_free == 8


# -- the tensor side ----------------------------------------------------------------------------
def _pool(num_blocks: int = 6, dtype: str = "float32") -> PagedKVPool:
    return PagedKVPool(ModelConfig.tiny(dtype=dtype), num_blocks, block_size=BS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_payload_is_page_first(dtype: str) -> None:
    pool = _pool(dtype=dtype)
    c = pool.config
    assert pool.kv.shape == (6, c.layers, 2, BS, c.kv_heads, c.head_dim) and pool.kv.is_contiguous()
    es = pool.kv.element_size()
    assert pool.block_nbytes == c.layers * 2 * BS * c.kv_heads * c.head_dim * es
    pool.kv[3, 1, 1, 2, 1, 5] = 7.0  # layer 1, V, slot 2, head 1, dim 5
    view = pool.block_bytes_view(3)
    assert view.dtype == torch.uint8 and view.is_contiguous() and view.numel() == pool.block_nbytes
    offset = ((((1 * 2 + 1) * BS + 2) * c.kv_heads + 1) * c.head_dim + 5) * es
    expected = torch.tensor([7.0], dtype=pool.dtype).view(torch.uint8)
    assert torch.equal(view[offset : offset + es], expected)
    view.zero_()  # a view, not a copy
    assert pool.kv[3].abs().sum() == 0


def test_write_kv_lands_in_the_planned_slots() -> None:
    pool = _pool()
    c = pool.config
    pool.add_sequence("s")
    slots = pool.append_slots("s", 6)
    k = torch.arange(6 * c.kv_heads * c.head_dim, dtype=torch.float32).reshape(6, c.kv_heads, c.head_dim)
    pool.write_kv(1, slots, k, -k)
    table = pool.block_table("s")
    for t in range(6):
        assert torch.equal(pool.kv[table[t // BS], 1, 0, t % BS], k[t])
        assert torch.equal(pool.kv[table[t // BS], 1, 1, t % BS], -k[t])
    kg, vg = pool.gather_kv(1, torch.tensor(table))
    assert torch.equal(kg[:, :6].transpose(0, 1), k) and torch.equal(vg[:, :6].transpose(0, 1), -k)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy", "tensor", "typed-tensor"])
def test_load_block_round_trips_payloads(kind: str) -> None:
    src, dst = _pool(dtype="bfloat16"), _pool(dtype="bfloat16")
    src.kv[2].copy_(torch.randn(src.kv.shape[1:], generator=torch.Generator().manual_seed(0)))
    raw = src.block_bytes_view(2)
    payload = {
        "bytes": lambda: bytes(raw.numpy()),
        "bytearray": lambda: bytearray(raw.numpy()),
        "memoryview": lambda: memoryview(raw.numpy()),
        "numpy": lambda: raw.numpy().copy(),
        "tensor": lambda: raw.clone(),
        "typed-tensor": lambda: src.kv[2].clone(),
    }[kind]()
    dst.load_block(5, payload)
    assert torch.equal(dst.kv[5], src.kv[2])
    assert dst.kv[:5].abs().sum() == 0


def test_load_block_rejects_wrong_sizes() -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="bytes"):
        pool.load_block(0, b"\0" * (pool.block_nbytes - 1))
    with pytest.raises(ValueError):
        pool.load_block(0, np.zeros(pool.block_nbytes, dtype=np.float16))


def test_cow_copies_block_contents() -> None:
    pool = _pool()
    pool.add_sequence("a")
    pool.append_slots("a", 6)
    table = pool.block_table("a")
    pool.kv[table[1]].fill_(3.0)
    pool.fork("a", "b")
    slots = pool.append_slots("b", 1)
    new_block = pool.block_table("b")[1]
    assert new_block != table[1] and int(slots.blocks[0]) == new_block
    assert torch.equal(pool.kv[new_block], pool.kv[table[1]])
    pool.kv[new_block].fill_(9.0)
    assert bool((pool.kv[table[1]] == 3.0).all())


def test_extend_with_payloads_and_sequence_payloads() -> None:
    src, dst = _pool(), _pool()
    src.add_sequence("s")
    src.append_slots("s", 9)
    src.kv.normal_(generator=torch.Generator().manual_seed(1))
    payloads = src.sequence_payloads("s")
    assert len(payloads) == 2  # only full blocks travel
    dst.add_sequence("t")
    ids = dst.extend_with_payloads("t", [bytes(p.numpy()) for p in payloads])
    assert dst.num_tokens("t") == 8
    for i, b in enumerate(ids):
        assert torch.equal(dst.kv[b], src.kv[src.block_table("s")[i]])
    with pytest.raises(ValueError):
        src.sequence_payloads("s", 0, 3)


@pytest.mark.skipif(not thp_on(), reason="transparent huge pages are off on this kernel")
def test_a_cpu_pool_is_zeroed_and_in_huge_pages() -> None:
    """The store writes fetched blocks into the pool page by page (process_vm_writev): 4 KiB pages cost 1.3-1.5x."""
    before = fallbacks()
    pool = _pool(num_blocks=8 * HUGE_PAGE // _pool(1).block_nbytes + 1)
    nbytes = pool.kv.numel() * pool.kv.element_size()
    assert nbytes > 8 * HUGE_PAGE and not pool.kv.any()
    pool.kv.view(-1).view(torch.uint8)[::4096] = 1  # faulted in
    got = huge_kib(pool.kv.data_ptr(), nbytes)
    skip_if_the_kernel_ran_short(got, 8 * HUGE_PAGE // 1024, before)
    assert got >= 8 * HUGE_PAGE // 1024
