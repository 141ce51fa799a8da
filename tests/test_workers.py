"""prefill_node -> store -> decode_node over real gRPC, against one process computing everything."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

torch = pytest.importorskip("torch")

from decode_node.engine import DecodeEngine  # noqa: E402
from decode_node.service import DecodeServicer  # noqa: E402
from kvstore.model import greedy_generate, load_model  # noqa: E402
from kvstore.model.store_link import StoreLink  # noqa: E402
from kvstore.v1 import workers_pb2 as wpb  # noqa: E402
from kvstore.v1 import workers_pb2_grpc as wpb_grpc  # noqa: E402
from prefill_node.service import PrefillServicer  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny")
    return model


def start_grpc(register):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def workers(tiny, server):
    store = f"127.0.0.1:{server.port}"
    # the decode pool shared with the store even in 4 KiB pages ("auto" shares only huge pages), so the path runs
    p_link, d_link = StoreLink(tiny, store), StoreLink(tiny, store, shared_pool="always")
    prefill = PrefillServicer(tiny, None, p_link, pool_blocks=256, chunk_tokens=64)
    engine = DecodeEngine(tiny, None, d_link, pool_blocks=256)
    p_srv, p_addr = start_grpc(lambda s: wpb_grpc.add_PrefillServiceServicer_to_server(prefill, s))
    d_srv, d_addr = start_grpc(lambda s: wpb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine), s))
    p_ch, d_ch = grpc.insecure_channel(p_addr), grpc.insecure_channel(d_addr)
    yield wpb_grpc.PrefillServiceStub(p_ch), wpb_grpc.DecodeServiceStub(d_ch), engine, d_link
    p_ch.close(), d_ch.close()
    p_srv.stop(0), d_srv.stop(0)
    engine.close()


def reference(model, tokens, n):
    pool = model.new_pool(256)
    return greedy_generate(model, pool, {0: tokens}, n)[0]


def generate(decode, tokens, n, use_store=True):
    replies = list(
        decode.Generate(
            wpb.GenerateRequest(
                prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=tokens)), namespace="t", max_new_tokens=n, use_store=use_store
            ),
            timeout=60,
        )
    )
    return [t for r in replies for t in r.token_ids], replies[0]


PROMPT = [(i * 37 + 11) % 250 + 1 for i in range(150)]  # 9 full blocks of 16 and a 6-token tail


def pooled_bytes(link: StoreLink) -> int:
    """Bytes of Gets that came into the decode worker's shared pool with one copy: written there by the store
    through its own mapping of the pool, or (a shared DRAM arena, ``--share-dram auto``) named in the arena and
    copied there by the worker (a namespace's first Get is asked: the later ones find the blocks in the index)."""
    counters = link.client.stats()["counters"]
    return int(counters.get("lane_shm_pool_get_bytes", 0) + counters.get("lane_shm_dram_get_bytes", 0))


def test_disaggregated_equals_one_process(tiny, workers):
    prefill, decode, _, link = workers
    reply = prefill.Prefill(
        wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=PROMPT)), namespace="t"), timeout=60
    )
    assert reply.stored_blocks == 9 and reply.cached_blocks == 0 and len(reply.hashes) == 9
    tokens, first = generate(decode, PROMPT, 12)
    assert first.cached_blocks == 9 and not first.recomputed and first.transfer_bytes > 0
    assert tokens == reference(tiny, PROMPT, 12)
    # the decode worker's pool is shared with its local store: the 9 blocks came into it with one copy
    assert pooled_bytes(link) == first.transfer_bytes
    again = prefill.Prefill(
        wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=PROMPT + [5] * 40)), namespace="t"), timeout=60
    )
    assert again.cached_blocks == 9 and again.stored_blocks == 2  # only the new blocks were computed and stored


def test_concurrent_requests_batch_and_match(tiny, workers):
    prefill, decode, _, _ = workers
    prompts = [PROMPT[: 40 + 17 * i] for i in range(4)]
    for p in prompts:
        prefill.Prefill(wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=p)), namespace="t"), timeout=60)
    with futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: generate(decode, p, 8)[0], prompts))
    for p, got in zip(prompts, results):
        assert got == reference(tiny, p, 8)


def test_store_down_falls_back_to_recompute(tiny, workers, server):
    prefill, decode, _, link = workers
    prefill.Prefill(wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=PROMPT)), namespace="t"), timeout=60)
    server.stop(0)
    tokens, first = generate(decode, PROMPT, 6)
    assert first.recomputed and first.cached_blocks == 0
    assert tokens == reference(tiny, PROMPT, 6)
    assert link.counters.recompute_fallbacks == 1


def test_corrupt_block_falls_back_to_recompute(tiny, workers, server):
    prefill, decode, _, link = workers
    reply = prefill.Prefill(
        wpb.PrefillRequest(prompt=wpb.Prompt(tokens=wpb.TokenIds(ids=PROMPT)), namespace="t"), timeout=60
    )
    store = server.store
    leases = store.acquire("t", [reply.hashes[4]])
    leases[0].buffer[100] ^= 0xFF  # flip a byte of a stored block in the arena
    store.release(leases)
    tokens, first = generate(decode, PROMPT, 6)
    assert first.recomputed and tokens == reference(tiny, PROMPT, 6)


def test_a_worker_shares_its_pool_only_with_a_local_store_and_when_asked(tiny, server, monkeypatch):
    import kvstore.model.store_link as store_link

    store = f"127.0.0.1:{server.port}"
    links = {
        name: StoreLink(tiny, store, **kwargs)
        for name, kwargs in {
            "always": {"shared_pool": "always"},
            "never": {"shared_pool": "never"},
            "auto, 4 KiB pages": {},
            "auto, huge pages": {},
            "tcp lane": {"shared_pool": "always", "lane": "tcp"},
        }.items()
    }
    try:
        monkeypatch.setattr(store_link, "huge_pages_likely", lambda n: False)
        assert links["always"].pool_memory(1 << 20) is not None
        assert links["never"].pool_memory(1 << 20) is None
        assert links["auto, 4 KiB pages"].pool_memory(1 << 20) is None
        assert links["tcp lane"].pool_memory(1 << 20) is None  # a store it reaches over TCP cannot map it
        monkeypatch.setattr(store_link, "huge_pages_likely", lambda n: True)
        memory = links["auto, huge pages"].pool_memory(1 << 20)
        assert memory is not None and memory.nbytes >= 1 << 20
    finally:
        for link in links.values():
            link.close()
    assert StoreLink(tiny, None, shared_pool="always").pool_memory(1 << 20) is None  # no store
    with pytest.raises(ValueError, match="shared_pool"):
        StoreLink(tiny, store, shared_pool="sometimes")


def test_workers_open_their_lane_before_the_first_request(tiny, server):
    store = f"127.0.0.1:{server.port}"
    links = [StoreLink(tiny, store, shared_pool="never") for _ in range(2)]
    engine = DecodeEngine(tiny, None, links[0], pool_blocks=16)
    PrefillServicer(tiny, None, links[1], pool_blocks=16)
    try:
        assert [link.client.lane_kind for link in links] == ["shm", "shm"]  # no request was made yet
    finally:
        engine.close()
        for link in links:
            link.close()
    assert StoreLink(tiny, None).connect() == ""
    down = StoreLink(tiny, "127.0.0.1:1")  # nothing listens there: the worker starts anyway
    try:
        assert down.connect() in ("", "grpc")
    finally:
        down.close()
