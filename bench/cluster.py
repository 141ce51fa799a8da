"""Cluster mode: aggregate throughput over 1, 2 and 3 store nodes, index publish rate, Redis memory per block.

    python -m bench.cluster [--quick] [--out bench/results/cluster.json]

1. Throughput: a throwaway redis-server and N `kvstore serve --redis` processes
   (N = 1, 2, 3) on this machine; ``--clients`` processes, each with its own
   ClusterClient (``Client("redis://...")``), put chains of ``--chain`` blocks of
   ``--block`` bytes (rendezvous places each chain on one node), wait until the
   index lists them, then get them all back. Aggregate GB/s is the bytes of all
   clients over the span from the first start to the last finish; per-node
   efficiency is GB/s(N) / (N x GB/s(1)). All processes share the same cores, so
   more nodes add no CPU: on a 2-core machine efficiency falls well below 1 and
   says so. Also the p50 latency of a cluster lookup (one pipelined index query)
   of a chain.
2. Index publishing, in this process: a BlockStore with an IndexPublisher on the
   same Redis; blocks/s from the first store Put until the index holds them all
   (incremental path, publisher racing the Puts) and of a full resync (snapshot).
3. Redis memory per indexed block: INFO used_memory before and after, divided by
   the blocks indexed; and MEMORY USAGE of one index hash / its fields.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from contextlib import ExitStack
from typing import Any

import redis

from bench.common import format_table, parse_args, positive, write_json
from kvstore.client import Client
from kvstore.cluster.keys import KeyLayout
from kvstore.cluster.localredis import LocalRedis
from kvstore.cluster.membership import read_members
from kvstore.server.process import store_process


def _client_worker(url: str, lane: str, chains: int, chain_len: int, block: int, barrier: Any, out: Any) -> None:
    payload = os.urandom(block)
    options = {} if lane == "auto" else {"lane": lane}
    with Client(url, timeout=120, refresh=0.5, **options) as kv:
        keys = [[os.urandom(16) for _ in range(chain_len)] for _ in range(chains)]
        for member in kv.directory.members():  # open every node's channel and lane before timing
            node = kv.directory.client(member)
            warm = [os.urandom(16) for _ in range(chain_len)]
            node.put("warm", warm, [payload] * chain_len)
            node.get("warm", warm)
        barrier.wait()
        t0 = time.monotonic()
        for chain in keys:
            results = kv.put("bench", chain, [payload] * chain_len)
            assert all(r.ok for r in results), results[0]
        t1 = time.monotonic()
        while not all(kv.lookup("bench", chain) == chain_len for chain in keys):
            time.sleep(0.01)
        barrier.wait()
        t2 = time.monotonic()
        for chain in keys:
            got = kv.get("bench", chain)
            assert len(got[-1]) == block
        t3 = time.monotonic()
        out.put((t0, t1, t2, t3, chains * chain_len * block))


def _lookup_p50_us(url: str, chain_len: int, n: int) -> float:
    with Client(url, refresh=0.5) as kv:
        chain = [os.urandom(16) for _ in range(chain_len)]
        kv.put("lat", chain, [b"x" * 4096] * chain_len)
        while kv.lookup("lat", chain) != chain_len:
            time.sleep(0.01)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            kv.lookup("lat", chain)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def throughput(url: str, nodes: int, args: Any, reps: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    puts, gets = [], []
    with ExitStack() as stack:
        for _ in range(nodes):
            stack.enter_context(store_process("--redis", url, "--dram", args.dram, "--cluster-ttl", "5"))
        r = redis.Redis.from_url(url)
        while len(read_members(r, KeyLayout())) != nodes:
            time.sleep(0.05)
        for _ in range(reps):
            barrier, out = ctx.Barrier(args.clients), ctx.Queue()
            procs = [
                ctx.Process(
                    target=_client_worker, args=(url, args.lane, args.chains, args.chain, args.block, barrier, out)
                )
                for _ in range(args.clients)
            ]
            for p in procs:
                p.start()
            spans = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join(60)
            total = sum(s[4] for s in spans)
            puts.append(total / (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e9)
            gets.append(total / (max(s[3] for s in spans) - min(s[2] for s in spans)) / 1e9)
        lookup_us = _lookup_p50_us(url, args.chain * 4, 50 if args.quick else 300)
        r.close()
    return {
        "nodes": nodes,
        "put_gbps": round(statistics.median(puts), 3),
        "get_gbps": round(statistics.median(gets), 3),
        "lookup_p50_us": round(lookup_us, 1),
    }


def _put_direct(store: Any, ns: str, key: bytes, data: bytes) -> None:
    from kvstore.checksum import crc32c
    from kvstore.tiers.base import BlockMeta

    ticket = store.begin_put(ns, BlockMeta(ns, key, b"", 0, "uint8", len(data), len(data), crc32c(data)))
    if ticket is not None:
        ticket.buffer[: len(data)] = data
        store.commit_put(ticket)


def publishing(url: str, blocks: int) -> list[dict[str, Any]]:
    from kvstore.cluster.connect import RedisConnector
    from kvstore.cluster.membership import Membership, NodeInfo
    from kvstore.cluster.publisher import IndexPublisher
    from kvstore.config import ServeConfig
    from kvstore.server.app import build_store

    r = redis.Redis.from_url(url)
    r.flushall()
    before = r.info("memory")["used_memory"]
    store = build_store(ServeConfig(dram=blocks * 4096 + (256 << 20), metrics_port=0))
    member = Membership(RedisConnector(url), NodeInfo(id="bench", addr="127.0.0.1:1", incarnation="b"), ttl=30)
    pub = IndexPublisher(store, RedisConnector(url), member, ttl=30)
    member.start()
    pub.start()
    rows = []
    try:
        while pub.index_id == 0:
            time.sleep(0.005)
        data = b"\0" * 4096
        start = time.perf_counter()
        for _ in range(blocks):
            _put_direct(store, "bench", os.urandom(16), data)
        put_s = time.perf_counter() - start
        while pub.pending or pub.published < blocks:
            time.sleep(0.002)
        indexed_s = time.perf_counter() - start
        rows.append(
            {
                "path": "incremental",
                "blocks": blocks,
                "store_puts_per_s": round(blocks / put_s),
                "publish_blocks_per_s": round(blocks / indexed_s),
            }
        )
        mem = (r.info("memory")["used_memory"] - before) / blocks
        sample = KeyLayout().index("bench", 0, pub.index_id)
        usage = r.memory_usage(sample, samples=0)
        assert usage is not None  # the index's hash exists: the publisher just wrote it
        per_field = usage / r.hlen(sample)
        encoding = r.object("encoding", sample).decode()
        old, start = pub.index_id, time.perf_counter()
        pub.request_resync()
        while pub.index_id == old or pub.pending:
            time.sleep(0.002)
        rows.append(
            {"path": "resync", "blocks": blocks, "publish_blocks_per_s": round(blocks / (time.perf_counter() - start))}
        )
        rows.append(
            {
                "path": "redis_memory",
                "blocks": blocks,
                "used_memory_bytes_per_block": round(mem, 1),
                "memory_usage_bytes_per_field": round(per_field, 1),
                "encoding": encoding,
            }
        )
    finally:
        pub.stop()
        member.stop()
        store.close(flush=False)
        r.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument("--clients", type=positive(int), default=2, help="client processes (default 2)")
        p.add_argument("--block", type=positive(int), default=1 << 20, help="block bytes (default 1 MiB)")
        p.add_argument("--chain", type=positive(int), default=8, help="blocks per chain, one put each (default 8)")
        p.add_argument(
            "--chains", type=positive(int), default=None, help="chains per client (default 8 quick, 32 full)"
        )
        p.add_argument("--dram", default="2GiB", help="DRAM tier of each node (pageable: only what is written is used)")
        p.add_argument(
            "--lane",
            default="grpc",
            help="client data lane: grpc (default; what remote clients use) or "
            "auto (shared memory to nodes on this host)",
        )
        p.add_argument("--index-blocks", type=positive(int), default=None, help="blocks for the publish/memory part")

    args = parse_args("cluster mode throughput and index costs", argv, configure)
    args.chains = args.chains or (8 if args.quick else 32)
    reps = 1 if args.quick else 3
    load_before = os.getloadavg()[0]
    with LocalRedis() as local:
        scaling = [throughput(local.url, n, args, reps) for n in (1, 2, 3)]
        base = scaling[0]
        for row in scaling:
            row["put_efficiency"] = round(row["put_gbps"] / (row["nodes"] * base["put_gbps"]), 2)
            row["get_efficiency"] = round(row["get_gbps"] / (row["nodes"] * base["get_gbps"]), 2)
            row.update(
                {
                    "clients": args.clients,
                    "block_bytes": args.block,
                    "chain": args.chain,
                    "lane": args.lane,
                    "cpus": os.cpu_count(),
                    "loadavg_1m_before": round(load_before, 2),
                    "loadavg_1m_after": round(os.getloadavg()[0], 2),
                }
            )
        index_rows = publishing(local.url, args.index_blocks or (50_000 if args.quick else 200_000))
    print(
        f"aggregate throughput ({args.clients} client processes, {args.chains} chains x {args.chain} blocks of "
        f"{args.block >> 10} KiB each per client and rep, lane {args.lane}, {os.cpu_count()} CPUs shared by "
        f"everything; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)"
    )
    print(format_table(scaling, ["nodes", "put_gbps", "get_gbps", "put_efficiency", "get_efficiency", "lookup_p50_us"]))
    print("\nglobal index")
    print(format_table(index_rows))
    if args.out:
        write_json(
            args.out,
            [{"part": "scaling", **r} for r in scaling] + [{"part": "index", **r} for r in index_rows],
            args,
            bench="cluster",
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
