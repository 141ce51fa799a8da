"""The vLLM connector's pure parts, without vLLM: identity, settings, the scheduler side's plans, cache blocks.

Requests and scheduler outputs are small stand-ins with the attributes the connector reads; lookups go to a
real in-process store where tenancy matters.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch

from kvstore.client import Client
from kvstore.hashing import block_hashes
from kvstore.integrations.vllm.cache_blocks import CacheBlocks, order_layers
from kvstore.integrations.vllm.identity import EngineShape, lora_adapter_id, prompt_hashes, request_namespace
from kvstore.integrations.vllm.plan import BlockRun, StepPlan
from kvstore.integrations.vllm.scheduler import LoadQuery, SchedulerSide
from kvstore.integrations.vllm.settings import ClientSlot, Settings
from kvstore.integrations.vllm.worker import MAX_LOAD_CHUNK, STAGED_LOAD_CHUNK, auto_load_chunk

SHAPE = EngineShape("m", "", "float32", 30, 3, 64, 32, "vllm-LBHNC-tp1")
B = SHAPE.block_size


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: object = None


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Out:
    scheduled_new_reqs: list[NewReq]
    num_scheduled_tokens: dict[str, int]
    scheduled_cached_reqs: Cached = field(default_factory=Cached)
    new_block_ids_to_zero: list[int] | None = None
    preempted_req_ids: set[str] | None = None


class FakeStore:
    """Lookup over a set of held hashes (the leading run present), counting calls."""

    def __init__(self, held: set[bytes] | None = None, fail: bool = False):
        self.held, self.fail, self.calls = held or set(), fail, 0

    def __call__(self, namespace: str, hashes) -> tuple[int, list[str]]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("store down")
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n, ["dram"] * n


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(n)]


def side(store: FakeStore, *, loads: bool = True, saves: bool = True, planner=None) -> SchedulerSide:
    kw = {"planner": planner} if planner else {}
    return SchedulerSide(SHAPE, "ns", store, loads=loads, saves=saves, block_bytes=1 << 20, **kw)


# -- identity ------------------------------------------------------------------------------------------
def test_every_part_of_the_engine_shape_changes_the_fingerprint() -> None:
    base = SHAPE.fingerprint()
    changed = [
        replace(SHAPE, model="other"),
        replace(SHAPE, revision="r2"),
        replace(SHAPE, dtype="bfloat16"),
        replace(SHAPE, layers=29),
        replace(SHAPE, kv_heads=4),
        replace(SHAPE, head_size=128),
        replace(SHAPE, block_size=64),
        replace(SHAPE, layout="vllm-LBHNC-tp0of2"),
    ]
    prints = {s.fingerprint() for s in changed} | {SHAPE.fingerprint("lora:a:1:/p")}
    assert base not in prints and len(prints) == len(changed) + 1


def test_namespace_and_hashes() -> None:
    assert request_namespace("team", None) == "team"
    salted = request_namespace("team", "secret")
    assert salted.startswith("team/salt-") and "secret" not in salted
    assert salted != request_namespace("team", "other") and salted == request_namespace("team", "secret")
    toks = tokens(100)
    assert prompt_hashes(toks, SHAPE, "team") == block_hashes(toks, B, "team", SHAPE.fingerprint())
    assert len(prompt_hashes(toks, SHAPE, "team")) == 3
    assert lora_adapter_id(None) == ""
    lora = type("L", (), {"lora_name": "a", "lora_int_id": 3, "lora_path": "/x"})()
    assert lora_adapter_id(lora) == "lora:a:3:/x"
    assert prompt_hashes(toks, SHAPE, "team", "lora:a:3:/x") != prompt_hashes(toks, SHAPE, "team")


def vllm_config(tp: int, pp: int = 1, rank: int = 0, dcp: int = 1, mla: bool = False) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` that ``EngineShape.from_vllm`` reads."""
    model = SimpleNamespace(
        model="m", revision=None, dtype="torch.float32",
        get_num_layers=lambda parallel: 30 // pp, get_num_kv_heads=lambda parallel: 4 // tp, get_head_size=lambda: 64,
        use_mla=mla,
    )  # fmt: skip
    cache = SimpleNamespace(
        cache_dtype="auto", block_size=32, get_resolved_kv_cache_layout=lambda: SimpleNamespace(name="LBHNC")
    )
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank,
                               decode_context_parallel_size=dcp)  # fmt: skip
    return SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)


def test_each_worker_rank_has_its_own_fingerprint() -> None:
    one = EngineShape.from_vllm(vllm_config(1))
    assert (one.layout, one.world, one.rank_layouts, one.for_rank(0)) == ("vllm-LBHNC-tp1", 1, (), one)
    scheduler, second = EngineShape.from_vllm(vllm_config(2)), EngineShape.from_vllm(vllm_config(2, rank=1))
    assert scheduler.layout == "vllm-LBHNC-tp0of2" and second.layout == "vllm-LBHNC-tp1of2"
    assert scheduler.for_rank(1) == second and second.for_rank(0) == scheduler  # any process knows every rank
    staged = EngineShape.from_vllm(vllm_config(2, pp=2, rank=3))
    assert staged.rank_layouts == tuple(f"vllm-LBHNC-tp{t}of2-pp{p}of2" for p in (0, 1) for t in (0, 1))
    prints = {staged.for_rank(r).fingerprint() for r in range(staged.world)} | {one.fingerprint()}
    assert len(prints) == 5  # no two workers' parts of a block share a key
    groups = lambda n: SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[f"l{i}" for i in range(n)])])  # noqa: E731
    assert EngineShape.from_vllm(vllm_config(1), kv_cache_config=groups(30)) == one  # the model's layers
    drafted = EngineShape.from_vllm(vllm_config(1), kv_cache_config=groups(31))  # a draft model's layer too
    assert drafted.layout == "vllm-LBHNC-tp1-kvlayers31" and drafted.fingerprint() != one.fingerprint()
    sharded = EngineShape.from_vllm(vllm_config(2, rank=1, dcp=2))  # decode context parallel: tokens sharded too
    assert sharded.layout == "vllm-LBHNC-rank1of2-tp2-pp1-pcp1-dcp2" and sharded.fingerprint() != second.fingerprint()


def test_several_workers_look_up_load_and_save_every_ranks_blocks() -> None:
    """With tensor parallelism each worker holds other heads of a block: a rank moving rank 0's keys would
    store its part where rank 0's is (the second Put refused as present) and load rank 0's part as its own."""
    shape = EngineShape.from_vllm(vllm_config(2))
    toks = tokens(200)  # 6 full blocks
    chains = [prompt_hashes(toks, shape.for_rank(r), "ns") for r in range(2)]
    assert not set(chains[0]) & set(chains[1])
    store = FakeStore(set(chains[0][:5]) | set(chains[1][:3]))  # rank 1's part of blocks 3 and 4 is missing
    s = SchedulerSide(shape, "ns", store, loads=True, saves=True, block_bytes=1 << 20)
    req = Req("r", toks)
    assert s.matched_tokens(req, 0) == 3 * B and store.calls == 2  # a block loads only if every rank has it
    s.after_alloc(req, list(range(10, 17)), 3 * B)
    plan = s.step_plan(Out([NewReq("r", (list(range(10, 17)),), 3 * B)], {"r": 200 - 3 * B}))
    (load,), (save,) = plan.loads, plan.saves
    assert load.for_rank(1) == BlockRun("r", "ns", tuple(chains[1][:3]), (10, 11, 12))
    assert save.for_rank(0) == BlockRun("r", "ns", tuple(chains[0][3:6]), (13, 14, 15), chains[0][2])
    assert save.for_rank(1) == BlockRun("r", "ns", tuple(chains[1][3:6]), (13, 14, 15), chains[1][2])
    assert pickle.loads(pickle.dumps(plan)) == plan
    with pytest.raises(ValueError, match="every rank"):
        BlockRun("r", "ns", (b"a",), (1,), b"", ((b"a",), ()), (b"", b""))


def test_mla_tensor_parallel_ranks_share_one_copy_of_each_block() -> None:
    """An MLA latent is the same on every TP rank: one chain, one Lookup, and only rank 0 Puts."""
    ranks = [EngineShape.from_vllm(vllm_config(2, rank=r, mla=True)) for r in range(2)]
    assert [s.layout for s in ranks] == ["vllm-LBHNC-tp1"] * 2 and [s.stores_saves for s in ranks] == [True, False]
    assert EngineShape.from_vllm(vllm_config(2, rank=1)).stores_saves  # heads split: every rank stores its own
    toks = tokens(200)
    chain = prompt_hashes(toks, ranks[0], "ns")
    store = FakeStore(set(chain))
    s = SchedulerSide(ranks[0], "ns", store, loads=True, saves=False, block_bytes=1 << 20)
    req = Req("r", toks)
    assert s.matched_tokens(req, 0) == 6 * B and store.calls == 1
    s.after_alloc(req, list(range(10, 17)), 6 * B)
    (load,) = s.step_plan(Out([NewReq("r", (list(range(10, 17)),), 6 * B)], {"r": 200 - 6 * B})).loads
    assert load.for_rank(0) == load.for_rank(1) == BlockRun("r", "ns", tuple(chain[:6]), tuple(range(10, 16)))


# -- settings ------------------------------------------------------------------------------------------
def test_settings_check_their_keys() -> None:
    s = Settings.from_extra({"target": "127.0.0.1:1", "timeout": "2.5", "load_chunk": "8", "tls_ca_file": "/ca"})
    assert (s.timeout, s.load_chunk, s.tls_ca, s.lane) == (2.5, 8, "/ca", "auto")
    with pytest.raises(ValueError, match="unknown"):
        Settings.from_extra({"target": "x:1", "namespac": "typo"})
    with pytest.raises(ValueError, match="target"):
        Settings.from_extra({"namespace": "x"})
    with pytest.raises(ValueError, match="on_load_error"):
        Settings.from_extra({"target": "x:1", "on_load_error": "ignore"})
    assert Settings.from_extra({"target": "x:1"}).load_chunk == 0  # chosen from the block size
    with pytest.raises(ValueError, match="load_chunk >= 0"):
        Settings.from_extra({"target": "x:1", "load_chunk": "-1"})
    assert Settings.from_extra({"target": "x:1", "staging": "device"}).staging == "device"
    with pytest.raises(ValueError, match="staging must be one of auto, host, device"):
        Settings.from_extra({"target": "x:1", "staging": "gpu"})


@pytest.mark.parametrize(
    ("extra", "says"),
    [  # each was taken at the engine's start and failed every load and save later, or waited for ever
        ({"timeout": "abc"}, "timeout: could not convert"),  # the key is named, not only int()'s words
        ({"timeout": 0}, "timeout must be seconds above 0"),
        ({"timeout": "nan"}, "timeout must be seconds above 0"),
        ({"retries": -1}, "retries must be >= 0"),
        ({"lane": "warp"}, "lane must be one of auto, grpc, shm, tcp, cuda_ipc"),
        ({"codec": "bogus"}, "codec: auto or unknown codec 'bogus'"),
        ({"target": "127.0.0.1:99999"}, "the port must be 0-65535"),
    ],
)
def test_settings_refuse_what_the_client_would_refuse_later(extra: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        Settings.from_extra({"target": "x:1", **extra})
    assert Settings.from_extra({"target": "x:1", "codec": "auto", "lane": "shm", "retries": 0}).codec == "auto"


def test_load_chunk_of_0_takes_about_90_mib_a_get_on_a_host_cache() -> None:
    smollm2 = 30 * 49_152  # bytes of a SmolLM2 block at 32 tokens, fp32
    assert auto_load_chunk(smollm2, host=True) == 64
    assert auto_load_chunk(smollm2, host=False) == STAGED_LOAD_CHUNK  # two staging buffers of it on a GPU
    assert auto_load_chunk(64 << 20, host=True) == 1
    assert auto_load_chunk(4096, host=True) == MAX_LOAD_CHUNK


def test_client_slot_rebuilds_after_a_failure() -> None:
    built: list[object] = []

    class C:
        closed = False

        def close(self) -> None:
            self.closed = True

    def make() -> C:
        built.append(C())
        return built[-1]

    slot = ClientSlot(make)
    assert slot.call(lambda c: 1) == 1 and slot.call(lambda c: 2) == 2 and len(built) == 1
    with pytest.raises(ZeroDivisionError):
        slot.call(lambda c: 1 / 0)
    assert built[0].closed and slot.call(lambda c: 3) == 3 and len(built) == 2


# -- scheduler side -----------------------------------------------------------------------------------
def test_loads_leave_one_token_to_compute() -> None:
    toks = tokens(64)  # exactly two full blocks
    store = FakeStore(set(prompt_hashes(toks, SHAPE, "ns")))
    s = side(store)
    assert s.matched_tokens(Req("r", toks), 0) == B  # block 2 holds the last token: recomputed
    assert s.matched_tokens(Req("q", toks + [5]), 0) == 2 * B  # one more token: both blocks load


def test_a_failed_lookup_counts_as_no_hit() -> None:
    s = side(FakeStore(fail=True))
    assert s.matched_tokens(Req("r", tokens(200)), 0) == 0
    assert s.counters.lookup_failures == 1


def test_load_plan_binds_the_allocated_blocks_and_skips_local_hits() -> None:
    toks = tokens(200)  # 6 full blocks, 7 vLLM blocks
    hashes = prompt_hashes(toks, SHAPE, "ns")
    s = side(FakeStore(set(hashes[:5])), saves=False)
    req = Req("r", toks)
    assert s.matched_tokens(req, B) == 4 * B  # vLLM has block 0; the store blocks 1..4
    s.after_alloc(req, [10, 11, 12, 13, 14, 15, 16], 4 * B)
    out = Out([NewReq("r", ([10, 11, 12, 13, 14, 15, 16],), B)], {"r": 200 - B}, new_block_ids_to_zero=[11, 15, 16])
    plan = s.step_plan(out)
    assert plan.loads == [BlockRun("r", "ns", tuple(hashes[1:5]), (11, 12, 13, 14), hashes[0])]
    assert out.new_block_ids_to_zero == [15, 16] and plan.saves == []
    assert s.step_plan(Out([], {})).loads == []  # a load is planned once
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert s.finished(req) is False


def test_planner_caps_the_load() -> None:
    toks = tokens(200)
    seen: list[LoadQuery] = []

    def cap_two(q: LoadQuery) -> int:
        seen.append(q)
        return 2

    s = side(FakeStore(set(prompt_hashes(toks, SHAPE, "ns"))), planner=cap_two)
    assert s.matched_tokens(Req("r", toks), 0) == 2 * B
    assert seen[0].hit_blocks == 6 and seen[0].tiers == ("dram",) * 6 and seen[0].computed_blocks == 0


def test_saves_cover_new_full_prompt_blocks_once() -> None:
    toks = tokens(200)
    hashes = prompt_hashes(toks, SHAPE, "ns")
    s = side(FakeStore(set(hashes[:2])), loads=False)
    req = Req("r", toks)
    assert s.matched_tokens(req, 0) == 0  # a producer loads nothing, but learns what the store has
    s.after_alloc(req, list(range(20, 24)), 0)
    first = s.step_plan(Out([NewReq("r", ([20, 21, 22, 23],), 0)], {"r": 128}))  # chunked prefill: 4 blocks
    assert first.saves == [BlockRun("r", "ns", tuple(hashes[2:4]), (22, 23), hashes[1])]
    cached = Cached(["r"], set(), [([24, 25, 26],)], [128])
    second = s.step_plan(Out([], {"r": 72}, scheduled_cached_reqs=cached))
    assert second.saves == [BlockRun("r", "ns", tuple(hashes[4:6]), (24, 25), hashes[3])]
    decode = s.step_plan(Out([], {"r": 1}, scheduled_cached_reqs=Cached(["r"], set(), [None], [200])))
    assert decode.saves == []  # generated tokens are not saved; the prompt's blocks were, once
    assert s.counters.skipped_save_blocks == 2 and s.counters.planned_save_blocks == 4
    assert s.finished(req) is True and s.finished(req) is False


def test_preempted_ids_travel_in_the_plan() -> None:
    s = side(FakeStore())
    assert s.step_plan(Out([], {}, preempted_req_ids={"a"})).preempted == frozenset({"a"})
    assert StepPlan().load_block_ids == set()


def test_tenant_token_reaches_only_its_namespaces(make_server, tmp_path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        "tenants:\n"
        "  - {name: a, token: aaaaaaaaaaaaaaaaaaaa, namespaces: [team-a, 'team-a/*']}\n"
        "  - {name: b, token: bbbbbbbbbbbbbbbbbbbb, namespaces: [team-b, 'team-b/*']}\n"
    )
    server = make_server(tenants=str(tenants))
    target = f"127.0.0.1:{server.port}"
    toks = tokens(100)
    ns_a = request_namespace("team-a", "salt")
    hashes = prompt_hashes(toks, SHAPE, ns_a)
    with Client(target, token="a" * 20) as a, Client(target, token="b" * 20) as b:
        assert all(r.ok for r in a.put(ns_a, hashes, [bytes(64)] * len(hashes)))
        owner = SchedulerSide(SHAPE, "team-a", a.lookup_tiers, loads=True, saves=False, block_bytes=64)
        assert owner.matched_tokens(Req("r", toks, cache_salt="salt"), 0) == 3 * B
        other_salt = SchedulerSide(SHAPE, "team-a", a.lookup_tiers, loads=True, saves=False, block_bytes=64)
        assert other_salt.matched_tokens(Req("r", toks, cache_salt="pepper"), 0) == 0
        intruder = SchedulerSide(SHAPE, "team-a", b.lookup_tiers, loads=True, saves=False, block_bytes=64)
        assert intruder.matched_tokens(Req("r", toks, cache_salt="salt"), 0) == 0
        assert intruder.counters.lookup_failures == 1  # PERMISSION_DENIED: no hit, and counted


# -- cache blocks ----------------------------------------------------------------------------------------
def _caches(shared: bool) -> dict[str, torch.Tensor]:
    layers, blocks, page = 4, 6, (3, 32, 16)
    per = blocks * 3 * 32 * 16
    buf = torch.randn(layers * per)
    views = {f"model.layers.{i}.attn": buf[i * per : (i + 1) * per].view(blocks, *page) for i in range(layers)}
    return views if shared else {k: v.clone() for k, v in views.items()}


@pytest.mark.parametrize("shared", [True, False])
def test_gather_and_scatter_move_whole_blocks_across_layers(shared: bool) -> None:
    src, dst = _caches(shared), {k: torch.zeros_like(v) for k, v in _caches(shared).items()}
    a, b = CacheBlocks.from_caches(src), CacheBlocks.from_caches(dst)
    assert a.cross_layer_view is shared and a.block_bytes == 4 * 3 * 32 * 16 * 4
    staging = a.new_staging(2)
    a.gather([4, 1], staging)
    b.scatter([0, 5], staging)
    for name in src:
        assert torch.equal(dst[name][0], src[name][4]) and torch.equal(dst[name][5], src[name][1])
        assert not dst[name][2].any()
    b.zero([0])
    assert all(not dst[name][0].any() for name in dst)
    with pytest.raises(ValueError):
        a.gather([1, 2, 3], staging)


@pytest.mark.parametrize("shared", [True, False])
def test_segments_are_the_blocks_pages_in_place(shared: bool) -> None:
    src = _caches(shared)
    blocks = CacheBlocks.from_caches(src)
    assert blocks.host
    staging = blocks.new_staging(1)
    blocks.gather([3], staging)
    (seg,) = blocks.segments([3])
    assert seg.nbytes == blocks.block_bytes and len(seg.parts) == blocks.layers
    assert bytes(seg.join()) == staging[0].numpy().tobytes()
    seg.scatter(bytes(blocks.block_bytes))  # writes land in the cache itself, in every layer
    assert all(not t[3].any() for t in src.values()) and all(t[2].any() for t in src.values())


def test_layers_are_ordered_by_index() -> None:
    assert order_layers(["m.layers.10.a", "m.layers.2.a", "m.layers.0.a"]) == [
        "m.layers.0.a",
        "m.layers.2.a",
        "m.layers.10.a",
    ]
