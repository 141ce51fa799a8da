"""Fuzzing every KVStore RPC against a live `kvstore serve` subprocess with hypothesis.

Inputs per RPC: request messages built from random fields (namespaces with
control characters and over-long ones, hashes of every length, unknown enum
values), the same messages with bytes flipped, inserted, deleted or cut off,
and plain garbage bytes, all sent as raw bytes so the server does the parsing.
Put gets whole streams: well-formed blocks (right sizes and CRC), blocks with
wrong sizes, checksums or chunk splits, data before headers, garbage messages.
A tenth of the calls carry a missing or wrong bearer token.

Promises checked: every call ends before its deadline with a status from the
RPC's expected set (never UNKNOWN, INTERNAL or UNAVAILABLE: no handler crash,
no process crash), the node stays SERVING, and its RSS after the campaign is
within a bound of its RSS after warm-up. ``KVSTORE_FUZZ_INPUTS`` sets the
inputs per RPC (default 10,000, the CI size); the counts land in
tests/output/fuzz_counts.json and in the test output.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.v1 import kvstore_pb2 as pb
from tests.conftest import ServerProcess

INPUTS = int(os.environ.get("KVSTORE_FUZZ_INPUTS", "10000"))
CAMPAIGN_TIMEOUT = 600  # seconds: a campaign took 43-75 s on the loaded 2-core VM, near pytest's 120 s
CASES = 20  # cases hypothesis draws per example; each expands into VARIANTS inputs
VARIANTS = 5
CONCURRENCY = 32
CALL_TIMEOUT = 10.0
RSS_BOUND = 48 << 20
TOKEN = "fuzzing-tenant-token-00000000"
NS = "fz"
KNOWN = [bytes([i]) * 16 for i in range(16)]  # stored before fuzzing, so Get and Delete reach real blocks
C = grpc.StatusCode
BASE = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.UNAUTHENTICATED}
EXPECTED = {"Lookup": BASE, "Get": BASE | {C.NOT_FOUND}, "Put": BASE, "Delete": BASE, "Stats": BASE}
COUNTS: dict[str, Counter] = {}

# -- strategies --------------------------------------------------------------------------------------
# Hypothesis draws the structure of each case (fields, faults, mutations, a seed); a case expands into
# VARIANTS inputs (as drawn, mutated as drawn, randomly mutated from the seed, garbage), which keeps the
# per-input cost of generation far below the cost of the RPC.
namespaces = st.one_of(
    st.sampled_from([NS, NS, "other", ""]), st.text(max_size=12), st.text(min_size=250, max_size=270)
)
hashes = st.lists(
    st.one_of(
        st.sampled_from(KNOWN), st.binary(min_size=16, max_size=16), st.sampled_from(KNOWN), st.binary(max_size=40)
    ),
    max_size=40,
)  # the server allows 32; hashes are 16 bytes
credentials = st.sampled_from([TOKEN] * 36 + [None, "wrong-token-for-fuzzing-000", "Basic abc", ""])
mutations = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4)
enum_values = st.one_of(st.integers(0, 6), st.integers(-(2**31), 2**31 - 1))
seeds = st.integers(0, 2**32 - 1)


def mutate(data: bytes, ops: list[tuple[int, int, int]]) -> bytes:
    """Flip (0), insert (1) or delete (2) a byte, or cut the rest off (3)."""
    buf = bytearray(data)
    for op, pos, value in ops:
        i = pos % (len(buf) + 1)
        if op == 0 and buf:
            buf[i % len(buf)] ^= value or 1
        elif op == 1:
            buf[i:i] = bytes([value])
        elif op == 2 and buf:
            del buf[i % len(buf)]
        else:
            del buf[i:]
    return bytes(buf)


def random_ops(rng: random.Random) -> list[tuple[int, int, int]]:
    return [(rng.randrange(4), rng.randrange(1 << 16), rng.randrange(256)) for _ in range(rng.randint(1, 4))]


def unary_variants(case: tuple[Any, list[tuple[int, int, int]], int]) -> list[bytes]:
    message, ops, seed = case
    rng, encoded = random.Random(seed), message.SerializeToString()
    return [
        encoded,
        mutate(encoded, ops),
        mutate(encoded, random_ops(rng)),
        mutate(encoded, random_ops(rng)),
        rng.randbytes(rng.randrange(120)),
    ]


def unary_cases(messages: st.SearchStrategy[Any]) -> st.SearchStrategy[list[bytes]]:
    return st.tuples(messages, mutations, seeds).map(unary_variants)


unary_inputs = {
    "Lookup": unary_cases(st.builds(pb.LookupRequest, namespace=namespaces, hashes=hashes)),
    "Get": unary_cases(
        st.builds(
            pb.GetRequest,
            namespace=namespaces,
            hashes=hashes,
            accepted_codecs=st.lists(enum_values, max_size=4),
            allow_missing=st.booleans(),
        )
    ),
    "Delete": unary_cases(
        st.builds(pb.DeleteRequest, namespace=namespaces, hashes=st.lists(st.binary(max_size=24), max_size=40))
    ),
    "Stats": unary_cases(st.builds(pb.StatsRequest, namespace=namespaces)),
}


@st.composite
def blocks(draw: st.DrawFn, first: bool) -> list[pb.PutRequest]:
    """One block's messages: mostly well-formed, often with one field or the chunking wrong."""
    n, seed = draw(st.integers(0, 3000)), draw(seeds)
    data = random.Random(seed).randbytes(n)
    fault = draw(st.sampled_from(["none"] * 4 + ["crc", "stored", "raw", "codec", "dtype", "hash", "short", "long"]))
    header = pb.BlockHeader(
        hash=draw(st.sampled_from(KNOWN[:4]) | st.binary(min_size=16, max_size=16)),
        parent=draw(st.sampled_from([b"", KNOWN[0]]) | st.binary(max_size=20)),
        codec=draw(enum_values) if fault == "codec" else 0,
        raw_length=n,
        stored_length=n,
        crc32c=crc32c(data) ^ (fault == "crc"),
        dtype=draw(st.sampled_from(["uint8", "bfloat16", "", "nope"])),
    )
    if fault in ("stored", "raw"):
        setattr(header, f"{fault}_length", draw(st.integers(0, 2**64 - 1)))
    if fault == "dtype":
        header.dtype = draw(st.text(max_size=8))
    if fault == "hash":
        header.hash = draw(st.binary(max_size=20))
    body = data[:-1] if fault == "short" and data else data + b"x" if fault == "long" else data
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]
    msgs = [pb.PutRequest(namespace=draw(namespaces) if first else "", header=header, data=pieces[0])]
    return msgs + [pb.PutRequest(data=p) for p in pieces[1:]]


def stream_variants(case: tuple[list[pb.PutRequest], list[tuple[int, int, int]], int]) -> list[list[bytes]]:
    """The stream as drawn; with a message mutated, a garbage message inserted, one dropped, one repeated."""
    msgs, ops, seed = case
    rng, raw = random.Random(seed), [m.SerializeToString() for m in msgs]
    where = rng.randrange(len(raw) + 1)
    mutated, inserted, dropped, repeated = list(raw), list(raw), list(raw), list(raw)
    if raw:
        i = rng.randrange(len(raw))
        mutated[i] = mutate(raw[i], ops or random_ops(rng))
        del dropped[i]
        repeated.insert(i, raw[i])
    inserted.insert(
        where,
        rng.randbytes(rng.randrange(60))
        if rng.random() < 0.5
        else pb.PutRequest(data=rng.randbytes(rng.randrange(64))).SerializeToString(),
    )
    return [raw, mutated, inserted, dropped, repeated]


@st.composite
def put_streams(draw: st.DrawFn) -> list[list[bytes]]:
    msgs = [m for i in range(draw(st.integers(0, 3))) for m in draw(blocks(i == 0))]
    return stream_variants((msgs, draw(mutations), draw(seeds)))


# -- the live server and the async client ---------------------------------------------------------------
class Campaign:
    """Unary and response-streaming calls go through grpc.aio (many in flight from one thread); Put
    streams through the sync API on a thread pool, because an aio client that is still writing when
    the server ends the call reports INTERNAL instead of the server's status (grpc/grpc#36066)."""

    def __init__(self, proc: ServerProcess):
        self.proc = proc
        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(self._open())
        self.sync_channel = grpc.insecure_channel(proc.target)
        self.pool = ThreadPoolExecutor(CONCURRENCY // 2)
        self.sem = asyncio.Semaphore(CONCURRENCY)
        self.rss_warm = 0

    async def _open(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.proc.target, options=[("grpc.max_send_message_length", 1 << 20)])

    async def _bounded(self, fn: Callable[[], Awaitable[None]]) -> tuple[grpc.StatusCode, str]:
        async with self.sem:
            try:
                await fn()
                return C.OK, ""
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details() or ""

    def run(self, method: str, cases: list[tuple[Any, str | None]]) -> list[tuple[grpc.StatusCode, str]]:
        path = f"/kvstore.v1.KVStore/{method}"
        if method == "Put":
            put = self.sync_channel.stream_unary(path)

            def stream(case: tuple[Any, str | None]) -> tuple[grpc.StatusCode, str]:
                try:
                    put(iter(case[0]), timeout=CALL_TIMEOUT, metadata=_metadata(case[1]))
                    return C.OK, ""
                except grpc.RpcError as err:
                    return err.code(), err.details() or ""

            return list(self.pool.map(stream, cases))

        def call(payload: Any, token: str | None) -> Callable[[], Awaitable[None]]:
            md = _metadata(token)

            async def go() -> None:
                if method == "Get":
                    async for _ in self.channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT, metadata=md):
                        pass
                else:
                    await self.channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT, metadata=md)

            return go

        async def batch() -> list[tuple[grpc.StatusCode, str]]:
            return await asyncio.gather(*(self._bounded(call(p, t)) for p, t in cases))

        return self.loop.run_until_complete(batch())

    def close(self) -> None:
        self.pool.shutdown()
        self.sync_channel.close()
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """A bearer token, or (fuzzing the header itself) a value that is not one."""
    if token is None:
        return None
    return (("authorization", f"Bearer {token}" if token and " " not in token else token),)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    tenants = tmp_path_factory.mktemp("fuzz") / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump([{"name": "fuzz", "token": TOKEN, "namespaces": ["*"], "admin": True, "max_streams": 0}])
    )
    proc = ServerProcess(
        "--dram",
        "64MiB",
        "--max-hashes",
        "32",
        "--max-block",
        "64KiB",
        "--max-message",
        "256KiB",
        "--max-stream",
        "1MiB",
        "--max-rpc-seconds",
        "8",
        "--workers",
        "16",
        "--tenants",
        str(tenants),
        "--log-level",
        "error",
        "--lanes",
        "",
    )
    with Client(proc.target, token=TOKEN) as kv:  # touch every arena page, then keep the known blocks
        for i in range(0, 1100, 15):  # 15 x 64 KiB per stream: under --max-stream
            kv.put(
                "fill", [j.to_bytes(16, "little") for j in range(i, i + 15)], [b"f" * (64 << 10)] * 15, chained=False
            )
        kv.put(NS, KNOWN, [k * 64 for k in KNOWN], chained=False)
    c = Campaign(proc)
    for method in EXPECTED:  # warm-up: a few hundred of each, then the RSS baseline
        c.run(method, [(b"", TOKEN)] * 100 if method != "Put" else [([b""], TOKEN)] * 100)
    c.rss_warm = proc.rss_bytes()
    yield c
    c.close()
    proc.kill9()
    out = Path(__file__).parent / "output"
    out.mkdir(exist_ok=True)
    (out / "fuzz_counts.json").write_text(json.dumps({m: dict(cnt) for m, cnt in COUNTS.items()}, indent=1) + "\n")


def fuzz(campaign: Campaign, method: str, cases: st.SearchStrategy[Any]) -> None:
    counts: Counter = COUNTS.setdefault(method, Counter())
    bad: list[str] = []

    @settings(
        max_examples=math.ceil(INPUTS / (CASES * VARIANTS)),
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(st.tuples(cases, credentials), min_size=CASES, max_size=CASES))
    def batch(drawn: list[tuple[list[Any], str | None]]) -> None:
        inputs = [(variant, token) for variants, token in drawn for variant in variants]
        results = campaign.run(method, inputs)
        for (payload, token), (code, details) in zip(inputs, results):
            counts[code.name] += 1
            if code not in EXPECTED[method]:
                bad.append(f"{code.name}: {details!r} for {payload!r:.200} (token {token is not None})")
        assert not bad, "\n".join(bad[:5])

    started = time.monotonic()
    batch()
    total = sum(counts.values())
    print(f"\n{method}: {total} inputs in {time.monotonic() - started:.1f} s: {dict(counts)}")
    assert total >= INPUTS
    assert campaign.proc.proc.poll() is None, "the server died"


@pytest.mark.timeout(CAMPAIGN_TIMEOUT)  # a campaign's calls have their own deadlines; its total varies with the load
@pytest.mark.parametrize("method", ["Lookup", "Get", "Delete", "Stats"])
def test_fuzz_unary_requests(campaign, method):
    fuzz(campaign, method, unary_inputs[method])


@pytest.mark.timeout(CAMPAIGN_TIMEOUT)
def test_fuzz_put_streams(campaign):
    fuzz(campaign, "Put", put_streams())
    assert {"OK", "INVALID_ARGUMENT"} <= set(COUNTS["Put"])  # both good and bad streams were exercised


def test_node_still_serving_with_bounded_memory(campaign):
    """Runs after the campaign (file order): health, invariants visible in Stats, RSS growth."""
    assert sum(sum(c.values()) for c in COUNTS.values()) >= 5 * INPUTS or len(COUNTS) < 5
    with Client(campaign.proc.target, token=TOKEN) as kv:
        stats = kv.stats()
        assert kv.get(NS, KNOWN[8:], allow_missing=True)  # reads still work
    for tier in stats["tiers"]:
        assert tier["used_bytes"] <= tier["capacity_bytes"]
    growth = campaign.proc.rss_bytes() - campaign.rss_warm
    print(
        f"\nRSS after warm-up {campaign.rss_warm / 2**20:.1f} MiB, growth {growth / 2**20:.1f} MiB; "
        f"inputs: { ({m: sum(c.values()) for m, c in COUNTS.items()}) }"
    )
    assert growth < RSS_BOUND
