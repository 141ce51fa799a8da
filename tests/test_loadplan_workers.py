"""The load planner in the built-in workers, with real parts: a store (in-process or a `kvstore serve` process),
the tiny random-init model, the decode engine. Whatever fails (a killed store, a corrupt block in the middle of
the prefix, a node lost mid-Get, a block gone between Lookup and Get), the tokens equal recomputing, and the
leading blocks that arrived intact are used (counted), not discarded."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from decode_node.engine import DecodeEngine, Request  # noqa: E402
from kvstore.client import Client  # noqa: E402
from kvstore.hashing import block_hashes  # noqa: E402
from kvstore.loadplan import Plan, Planner, PlannerConfig  # noqa: E402
from kvstore.model import greedy_generate, load_model  # noqa: E402
from kvstore.model.store_link import StoreLink  # noqa: E402
from kvstore.v1 import workers_pb2 as wpb  # noqa: E402
from prefill_node.service import PrefillServicer  # noqa: E402

NS = "lp"
PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(150)]  # 9 full blocks of 16 and a 6-token tail
NEW = 6


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")[0]


def reference(model, tokens, n=NEW):
    return greedy_generate(model, model.new_pool(64), {0: tokens}, n)[0]


def populate(model, target: str, tokens=PROMPT) -> list[bytes]:
    """Compute the prompt's KV here and Put its full blocks (what a prefill worker leaves in the store)."""
    pool = model.new_pool(64)
    pool.add_sequence(0)
    model.prefill(pool, 0, tokens, logits="none")
    hashes = block_hashes(tokens, model.config.block_size, NS, model.config.fingerprint())
    with Client(target) as kv:
        assert all(r.ok for r in kv.put(NS, hashes, pool.sequence_payloads(0, 0, len(hashes))))
    return hashes


def generate(engine: DecodeEngine, tokens=PROMPT, policy="decide", n=NEW):
    req = engine.submit(Request(list(tokens), NS, n, True, policy=policy))
    out, first = [], None
    for token, f in req.stream():
        out.append(token)
        first = first or f
    return out, first


class ClientWith:
    """The link's real client, with a hook that runs before its n-th Get (a fault injected mid-request)."""

    def __init__(self, client, before_get):
        self._client, self._before, self.gets = client, before_get, 0

    def get(self, *args, **kwargs):
        self.gets += 1
        self._before(self.gets)
        return self._client.get(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture
def engine_on(tiny):
    made = []

    def make(target: str, **planner_cfg):
        link = StoreLink(tiny, target, planner=Planner(PlannerConfig(**planner_cfg)), timeout=10)
        engine = DecodeEngine(tiny, None, link, pool_blocks=128)
        made.append(engine)
        return engine, link

    yield make
    for engine in made:
        engine.close()
        engine.link.close()


def test_killed_store_gives_the_recomputed_tokens(tiny, spawn_server, engine_on):
    server = spawn_server("--dram", "64MiB")
    populate(tiny, server.target)
    engine, link = engine_on(server.target)
    tokens, first = generate(engine, policy="load")
    assert first.cached_blocks == 9 and tokens == reference(tiny, PROMPT)
    server.kill9()
    for policy in ("decide", "load"):
        tokens, first = generate(engine, policy=policy)
        assert tokens == reference(tiny, PROMPT)
        assert first.recomputed and first.cached_blocks == 0
    assert link.counters.recompute_fallbacks == 2
    assert link.planner.snapshot()["loadplan.lookup_failures"] == 2


def test_corrupt_block_in_the_middle_keeps_the_blocks_before_it(tiny, server, engine_on):
    target = f"127.0.0.1:{server.port}"
    hashes = populate(tiny, target)
    leases = server.store.acquire(NS, [hashes[4]])
    leases[0].buffer[100] ^= 0xFF  # flip a byte of block 4 in the arena: its CRC32C no longer matches
    server.store.release(leases)
    engine, link = engine_on(target)
    tokens, first = generate(engine, policy="load")
    assert tokens == reference(tiny, PROMPT)
    assert first.recomputed and first.cached_blocks == 4  # blocks 0-3 used, 4-8 recomputed
    snap = link.planner.snapshot()
    assert snap["loadplan.partial_loads"] == 1 and snap["loadplan.partial_blocks_used"] == 4
    assert snap["loadplan.blocks_discarded"] == 5


def test_node_lost_mid_get_keeps_the_pieces_that_arrived(tiny, spawn_server, engine_on):
    server = spawn_server("--dram", "64MiB")
    populate(tiny, server.target)
    engine, link = engine_on(server.target, piece_blocks=3)
    link.client = ClientWith(link.client, lambda n: server.kill9() if n == 2 else None)  # dies after piece 1
    tokens, first = generate(engine, policy="load")
    assert tokens == reference(tiny, PROMPT)
    assert first.recomputed and first.cached_blocks == 3
    snap = link.planner.snapshot()
    assert snap["loadplan.partial_blocks_used"] == 3 and snap["loadplan.blocks_discarded"] == 6


def test_block_gone_between_lookup_and_get(tiny, server, engine_on):
    target = f"127.0.0.1:{server.port}"
    hashes = populate(tiny, target)
    engine, link = engine_on(target)
    link.client = ClientWith(link.client, lambda n: server.store.delete(NS, [hashes[6]]) if n == 1 else None)
    tokens, first = generate(engine, policy="load")
    assert tokens == reference(tiny, PROMPT) and first.cached_blocks == 6
    assert link.planner.snapshot()["loadplan.partial_blocks_used"] == 6


class ForcedOverlap(Planner):
    """The real planner's plan, with (m, k) forced: compute blocks [0, m) while [m, k) loads."""

    def __init__(self, m: int, k: int):
        super().__init__(PlannerConfig(piece_blocks=2))
        self.m, self.k = m, k

    def plan(self, *args, **kwargs) -> Plan:
        plan = super().plan(*args, **kwargs)
        return dataclasses.replace(plan, compute_first=self.m, load_until=self.k, choice="overlap", piece_blocks=2)


@pytest.mark.parametrize("corrupt", [None, 5])
def test_overlap_computes_the_head_while_later_blocks_load(tiny, server, corrupt):
    target = f"127.0.0.1:{server.port}"
    hashes = populate(tiny, target)
    if corrupt is not None:
        leases = server.store.acquire(NS, [hashes[corrupt]])
        leases[0].buffer[7] ^= 0x01
        server.store.release(leases)
    link = StoreLink(tiny, target, planner=ForcedOverlap(3, 9))
    engine = DecodeEngine(tiny, None, link, pool_blocks=128)
    try:
        tokens, first = generate(engine)
        assert tokens == reference(tiny, PROMPT)
        assert first.head_blocks == 3
        assert first.cached_blocks == (6 if corrupt is None else corrupt - 3)
        assert engine.pool.num_free_blocks == 128  # reserved blocks that were not used went back
        if corrupt is not None:
            assert link.planner.snapshot()["loadplan.partial_blocks_used"] == 2
    finally:
        engine.close()
        link.close()


def test_prefill_worker_never_puts_again_what_the_store_holds(tiny, server):
    target = f"127.0.0.1:{server.port}"
    populate(tiny, target, PROMPT[:128])  # 8 blocks
    link = StoreLink(tiny, target, policy="recompute")
    servicer = PrefillServicer(tiny, None, link, pool_blocks=64, chunk_tokens=64)
    try:
        reply = servicer.Prefill(
            wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=PROMPT)), namespace=NS), None
        )
        assert reply.cached_blocks == 0 and reply.computed_tokens == 150  # recomputed by policy ...
        assert reply.stored_blocks == 1  # ... and only block 8, which the store lacked, was Put
        link.policy = "decide"
        again = servicer.Prefill(
            wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=PROMPT + [9] * 40)), namespace=NS), None
        )
        assert again.stored_blocks == 2 and again.cached_blocks + again.computed_tokens // 16 >= 9
    finally:
        link.close()


def test_server_stats_report_nvme_read_speed_and_seed_the_planner(make_server, tmp_path):
    import time

    server = make_server(dram=8 << 20, nvme_dir=str(tmp_path / "nvme"), nvme=1 << 30, promote_on_hit=False)
    keys = block_hashes(list(range(16 * 48)), 16, NS, "m")
    with Client(f"127.0.0.1:{server.port}") as kv:
        for lo in range(0, 48, 8):
            kv.put(NS, keys[lo : lo + 8], [bytes([i]) * (256 << 10) for i in range(lo, lo + 8)])
        deadline = time.monotonic() + 15
        while kv.lookup_tiers(NS, keys)[1].count("nvme") < 8:  # the demoter moves the oldest blocks down
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cold = [k for k, t in zip(keys, kv.lookup_tiers(NS, keys)[1]) if t == "nvme"]
        kv.get(NS, cold)
        counters = kv.stats()["counters"]
        assert counters["tier_nvme_read_bytes"] >= len(cold) * (256 << 10) and counters["tier_nvme_read_seconds"] > 0
        planner = Planner()
        planner.seed(counters, {}, "shm")
        speed = counters["tier_nvme_read_bytes"] / counters["tier_nvme_read_seconds"] / 1e9
        assert planner.snapshot()["loadplan.load.nvme_prior_gbps"] == pytest.approx(speed)
