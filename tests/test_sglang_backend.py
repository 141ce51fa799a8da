"""kvstore as SGLang's HiCache storage backend, against a real ``kvstore serve`` and SGLang's own
``HiCacheStorage`` base class and backend factory (SGLang's serving stack needs CUDA kernels, so its host pool
is stood in for by ``bench.sglang_hicache.PageFirstPool``: the memory layout and ``get_page_buffer_meta`` of
its MHA page_first pool).
Skipped where ``sglang`` does not import; ``pages.py``'s logic is tested without it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from bench.sglang_hicache import PageFirstPool
from kvstore.integrations.sglang.pages import PageKeys, fingerprint, page_segments

LAYERS, HEADS, DIM, PAGE = 4, 2, 16, 8


def small_pool(pages: int) -> PageFirstPool:
    return PageFirstPool(pages, layers=LAYERS, heads=HEADS, dim=DIM, page=PAGE)


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_page_segments_split_the_parts_in_order():
    bufs = [np.arange(8, dtype=np.uint8) + 8 * i for i in range(6)]
    pages = page_segments([b.ctypes.data for b in bufs], [b.nbytes for b in bufs], 3)
    assert [p.nbytes for p in pages] == [16, 16, 16]
    assert bytes(pages[1].views[0]) + bytes(pages[1].views[1]) == bytes(range(16, 32))
    with pytest.raises(ValueError, match="do not split"):
        page_segments([b.ctypes.data for b in bufs], [8] * 6, 4)


def test_page_keys_depend_on_the_fingerprint():
    a, b = PageKeys("model=a"), PageKeys("model=b")
    assert a.hash("ff00") == PageKeys("model=a").hash("ff00") != b.hash("ff00")
    assert len(a.hash("ff00")) == 16


def test_the_fingerprint_names_what_changes_the_bytes():
    class Config:
        model_name, tp_rank, tp_size, is_mla_model = "m", 0, 2, False

    base = fingerprint(Config(), small_pool(1))
    other_rank = Config()
    other_rank.tp_rank = 1
    half = small_pool(1)
    half.dtype = torch.bfloat16
    assert len({base, fingerprint(other_rank, small_pool(1)), fingerprint(Config(), half)}) == 3
    mla, mla_rank1 = Config(), Config()
    mla.is_mla_model = mla_rank1.is_mla_model = True
    mla_rank1.tp_rank = 1
    assert fingerprint(mla, small_pool(1)) == fingerprint(mla_rank1, small_pool(1)) != base  # replicated KV


def _config(model: str = "smollm2", **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model, extra_config=extra,
    )  # fmt: skip


@pytest.fixture
def sglang_store(spawn_server):
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    return spawn_server("--dram", "64MiB")


def _backend(store, pool, model="smollm2", **extra):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = _config(
        model, backend_name="kvstore", module_path="kvstore.integrations.sglang",
        class_name="KVStoreHiCacheStorage", interface_v1=1, target=store.target, **extra,
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)  # as SGLang's cache controller does after creating it
    return backend


def test_pages_round_trip_through_the_store_into_another_pool(sglang_store):
    from kvstore.integrations.sglang import KVStoreHiCacheStorage

    writer_pool, reader_pool = small_pool(8), small_pool(8)
    writer_pool.kv_buffer.copy_(torch.randn_like(writer_pool.kv_buffer))
    writer, reader = _backend(sglang_store, writer_pool), _backend(sglang_store, reader_pool)
    assert isinstance(writer, KVStoreHiCacheStorage)
    keys = [f"{i:064x}" for i in range(1, 5)]
    assert writer.batch_set_v1(keys, indices([0, 1, 2, 3])) == [True] * 4
    assert writer.batch_set_v1(keys[:2], indices([0, 1])) == [True, True]  # already there: still True
    assert reader.batch_exists(keys + ["ab" * 32]) == 4
    assert reader.batch_get_v1(keys[:3], indices([5, 2, 7])) == [True] * 3
    for src, dst in ((0, 5), (1, 2), (2, 7)):
        assert torch.equal(reader_pool.page(dst), writer_pool.page(src))
    assert reader.batch_get_v1(["cd" * 32, keys[3]], indices([4, 6])) == [False, True]
    writer.clear()
    reader.clear()


def test_another_model_or_rank_gets_no_hit(sglang_store):
    pool = small_pool(2)
    writer = _backend(sglang_store, pool)
    keys = ["01" * 32]
    assert writer.batch_set_v1(keys, indices([0])) == [True]
    assert _backend(sglang_store, pool, model="other").batch_exists(keys) == 0
    assert _backend(sglang_store, pool, namespace="tenant-b").batch_exists(keys) == 0
    assert _backend(sglang_store, pool).batch_exists(keys) == 1


def test_a_store_that_is_gone_is_a_miss_not_an_error(sglang_store):
    pool = small_pool(2)
    backend = _backend(sglang_store, pool, timeout=2, retries=0)
    keys = ["02" * 32]
    assert backend.batch_set_v1(keys, indices([0])) == [True]
    sglang_store.kill9()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, indices([1])) == [False]
    assert backend.batch_set_v1(keys, indices([1])) == [False]


def test_registering_the_pool_warms_the_clients_that_move_pages(sglang_store, monkeypatch):
    import threading

    from kvstore.node_client import NodeClient

    warmed: list[tuple[NodeClient, str]] = []  # holds the clients: an id() could be reused once one is freed
    used: dict[str, object] = {}
    real_warm_up, real_get, real_put, real_lookup = (
        NodeClient.warm_up,
        NodeClient.get,
        NodeClient.put,
        NodeClient.lookup,
    )

    def warm_up(client: NodeClient) -> str:
        warmed.append((client, real_warm_up(client)))
        return warmed[-1][1]

    def is_warm(client: object) -> bool:
        return any(client is warm for warm, _ in warmed)

    def spy(verb: str, real):  # noqa: ANN001, ANN202
        def call(client: NodeClient, *args, **kwargs):  # noqa: ANN002, ANN003
            used[verb] = client
            return real(client, *args, **kwargs)

        return call

    monkeypatch.setattr(NodeClient, "warm_up", warm_up)
    for verb, real in (("get", real_get), ("put", real_put), ("lookup", real_lookup)):
        monkeypatch.setattr(NodeClient, verb, spy(verb, real))
    pool = small_pool(4)
    backend = _backend(sglang_store, pool)
    assert [mode for _, mode in warmed] == ["shm", "shm"]  # at registration, before any verb: lanes open
    backend.register_mem_pool_host(pool)  # registered again: nothing more to warm
    assert len(warmed) == 2
    keys = ["03" * 32, "04" * 32]
    threads = [
        threading.Thread(target=lambda: backend.batch_exists(keys)),  # SGLang's prefetch thread: a lookup only
        threading.Thread(target=lambda: backend.batch_set_v1(keys, indices([0, 1]))),  # its backup thread
    ]
    for t in threads:
        t.start()
        t.join()
    got = threading.Thread(target=lambda: used.setdefault("ok", backend.batch_get_v1(keys, indices([2, 3]))))
    got.start()
    got.join()
    assert used["ok"] == [True, True] and torch.equal(pool.page(2), pool.page(0))
    assert is_warm(used["put"]) and is_warm(used["get"]) and used["put"] is not used["get"]
    assert not is_warm(used["lookup"])  # a thread that only looks up left the warm clients to the others
    assert len(warmed) == 2  # nothing else warmed up
    backend.clear()
    sglang_store.kill9()
    late = _backend(sglang_store, pool, timeout=2, retries=0, warm_clients=1)  # an engine starting, its store down
    assert [mode for _, mode in warmed[2:]] == ["grpc"]  # no lane opened, nothing raised
    assert late.batch_exists(keys) == 0  # and it serves misses


def test_a_backend_without_a_target_says_so():
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    from kvstore.integrations.sglang import KVStoreHiCacheStorage

    with pytest.raises(ValueError, match="target"):
        KVStoreHiCacheStorage(_config(), {})


@pytest.mark.parametrize(
    ("extra", "says"),
    [  # each would be taken at start and make every Get and Set a miss, recomputed without a word past a log line
        ({"timeout": "soon"}, "timeout: could not convert"),
        ({"timeout": "0"}, "timeout must be seconds above 0"),
        ({"retries": "-2"}, "retries must be >= 0"),
        ({"lane": "warp"}, "lane must be one of auto"),
        ({"codec": "bogus"}, "codec: auto or unknown codec 'bogus'"),
        ({"target": "127.0.0.1:99999"}, "target '127.0.0.1:99999': the port must be 0-65535"),
        ({"warm_clients": "two"}, "warm_clients: invalid literal"),
        ({"warm_clients": "-1"}, "warm_clients must be >= 0"),
    ],
)
def test_a_backend_refuses_client_options_the_client_would_refuse(extra, says):
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    from kvstore.integrations.sglang import KVStoreHiCacheStorage

    with pytest.raises(ValueError, match=re.escape(f"kvstore HiCache backend: {says}")):
        KVStoreHiCacheStorage(_config(**{"target": "127.0.0.1:1", **extra}), {})
    assert KVStoreHiCacheStorage(_config(target="127.0.0.1:1", lane="tcp", codec="auto", retries="0"), {}).target


def test_first_moves_bench_times_fresh_engines_both_ways():
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")
    from tqdm import tqdm

    from bench import sglang_first

    rows = sglang_first.measure(2, 1, tqdm(disable=True))  # each child checks every page it moved
    assert [r["warm_clients"] for r in rows] == list(sglang_first.WARM_CLIENTS)
    for r in rows:
        assert r["processes"] == 1 and r["get1_ms"] > 0 and r["put1_ms"] > 0 and r["warm_ms"] > 0
