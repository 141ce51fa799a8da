"""Fuzzing the data-lane service KVStoreLanes and the bulk TCP lane's framing against a live `kvstore serve`.

Part 1, gRPC: every KVStoreLanes RPC (OpenLane, LanePut, LaneGet, CloseLane) gets request messages built
from random fields (unknown lane kinds, host ids, lane refs that are real, forged or carry a wrong token,
random reserves/commits/descriptors/releases), the same messages with bytes flipped, inserted, deleted or
cut off, and plain garbage, all sent as raw bytes (identity serializers) so the server does the parsing.
LanePut gets whole streams. A tenth of the calls carry a missing or wrong bearer token. Promises: every
call ends before its deadline with a status from the RPC's expected set (never UNKNOWN, INTERNAL,
UNAVAILABLE, DEADLINE_EXCEEDED: no handler crash, no process crash, no hang).

Expected codes (from servicer.py, registry.py, access.py, storeops.py, grants.py, shm_server.py and the
Gatekeeper in server/auth.py): OK; INVALID_ARGUMENT (unparsable request, bad header or namespace, LanePut
message without a step); UNAUTHENTICATED (missing/wrong bearer token); PERMISSION_DENIED (wrong lane
token, descriptors that do not match a grant); FAILED_PRECONDITION (unknown or closed lane, a block that does
not fit the region, unknown grant); RESOURCE_EXHAUSTED (lane_max reached, block over --max-block); NOT_FOUND
(LaneGet of missing blocks without allow_missing).

Part 2, TCP framing: for each case a real tcp lane is opened (valid token) and a connection sends random,
mutated or structurally broken frames (garbage, truncated headers, huge declared metadata/payload lengths,
wrong CRCs, unknown kinds, payload length mismatches), or opens with a forged/garbled hello. Promises: the
server closes every connection (EOF) within a short timeout after the client stops sending, any STATUS frame
it sends carries a code from the expected set, no hash of a block whose frame was broken becomes visible
(checked with a normal Client lookup), and the node stays healthy (`kvstore health`).

``KVSTORE_FUZZ_LANE_INPUTS`` sets the inputs per RPC (default 10,000) and ``KVSTORE_FUZZ_FRAMES`` the framing
cases (default 1,000); hypothesis runs derandomized, so runs are deterministic.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.lanes import framing
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.conftest import ROOT, ServerProcess
from tests.test_fuzz import _metadata, enum_values, mutate, mutations, random_ops, seeds

INPUTS = int(os.environ.get("KVSTORE_FUZZ_LANE_INPUTS", "10000"))
FRAMES = int(os.environ.get("KVSTORE_FUZZ_FRAMES", "1000"))
CASES, VARIANTS = 20, 5
FRAME_CASES = 25
CONCURRENCY = 16
CALL_TIMEOUT = 10.0
SOCK_TIMEOUT = 8.0
TOKEN = "fuzzing-lanes-token-000000000"
NS = "fzl"
KNOWN = [bytes([0x80 | i]) * 16 for i in range(8)]
C = grpc.StatusCode
BASE = {C.OK, C.INVALID_ARGUMENT, C.UNAUTHENTICATED, C.PERMISSION_DENIED, C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED}
EXPECTED = {"OpenLane": BASE, "CloseLane": BASE, "LanePut": BASE, "LaneGet": BASE | {C.NOT_FOUND}}
FRAME_CODES = {c.value[0] for c in BASE | {C.NOT_FOUND}} - {0}
COUNTS: dict[str, Counter] = {}
SETTINGS = dict(
    deadline=None, database=None, derandomize=True, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
)


# -- the live server ------------------------------------------------------------------------------------
class Node:
    def __init__(self, proc: ServerProcess):
        self.proc = proc
        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(self._open())
        self.sync_channel = grpc.insecure_channel(proc.target)
        self.pool = ThreadPoolExecutor(CONCURRENCY)
        self.sem = asyncio.Semaphore(CONCURRENCY)
        opened = self.open(lpb.LANE_TCP)
        self.host_id = opened.host_id
        self.close_lane(opened)

    async def _open(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.proc.target)

    def open(self, kind: int, host_id: str = "") -> lpb.OpenLaneResponse:
        raw = self.sync_channel.unary_unary("/kvstore.v1.KVStoreLanes/OpenLane")(
            lpb.OpenLaneRequest(kinds=[kind], host_id=host_id).SerializeToString(),
            timeout=CALL_TIMEOUT,
            metadata=_metadata(TOKEN),
        )
        return lpb.OpenLaneResponse.FromString(raw)

    def close_lane(self, opened: lpb.OpenLaneResponse) -> None:
        if not opened.lane_id:
            return
        try:
            self.sync_channel.unary_unary("/kvstore.v1.KVStoreLanes/CloseLane")(
                lpb.CloseLaneRequest(lane=lpb.LaneRef(lane_id=opened.lane_id, token=opened.token)).SerializeToString(),
                timeout=CALL_TIMEOUT,
                metadata=_metadata(TOKEN),
            )
        except grpc.RpcError as err:  # already closed by a fuzzed CloseLane, or reaped
            assert err.code() in (C.FAILED_PRECONDITION, C.PERMISSION_DENIED), err

    def run(self, method: str, cases: list[tuple[Any, str | None]]) -> list[tuple[C, str, list[bytes]]]:
        path = f"/kvstore.v1.KVStoreLanes/{method}"
        if method == "LanePut":
            call = self.sync_channel.stream_stream(path)

            def stream(case: tuple[Any, str | None]) -> tuple[C, str, list[bytes]]:
                try:
                    out = list(call(iter(case[0]), timeout=CALL_TIMEOUT, metadata=_metadata(case[1])))
                    return C.OK, "", out
                except grpc.RpcError as err:
                    return err.code(), err.details() or "", []

            return list(self.pool.map(stream, cases))

        async def one(payload: bytes, token: str | None) -> tuple[C, str, list[bytes]]:
            async with self.sem:
                try:
                    md = _metadata(token)
                    if method == "LaneGet":
                        out = [
                            m async for m in self.channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT, metadata=md)
                        ]
                    else:
                        out = [await self.channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT, metadata=md)]
                    return C.OK, "", out
                except grpc.aio.AioRpcError as err:
                    return err.code(), err.details() or "", []

        async def batch() -> list[tuple[C, str, list[bytes]]]:
            return await asyncio.gather(*(one(p, t) for p, t in cases))

        return self.loop.run_until_complete(batch())

    def close(self) -> None:
        self.pool.shutdown()
        self.sync_channel.close()
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


def healthy(target: str) -> bool:
    return (
        subprocess.run(
            [sys.executable, "-m", "kvstore", "health", "--target", target, "--timeout", "5"],
            capture_output=True,
            cwd=ROOT,
        ).returncode
        == 0
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tenants = tmp_path_factory.mktemp("fuzzlanes") / "tenants.yaml"
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
        "shm,tcp",
        "--shm-lane-bytes",
        "1MiB",
        "--lane-max",
        "512",
        "--lane-lease",
        "5",
    )
    with Client(proc.target, token=TOKEN) as kv:
        kv.put(NS, KNOWN, [k * 64 for k in KNOWN], chained=False)
    n = Node(proc)
    yield n
    n.close()
    proc.kill9()
    logged = proc.output()
    print(f"\nserver logged {logged.count('Traceback')} tracebacks")
    assert "Traceback" not in logged, "malformed input must be a status, not a server traceback:\n" + logged[-3000:]


# -- strategies -----------------------------------------------------------------------------------------
# A case is drawn by hypothesis; it expands into VARIANTS inputs (as drawn, mutated as drawn, randomly mutated
# twice from the seed, garbage). Lane refs are placeholders ("LIVE"/"WRONG") that are bound per batch to the
# lane opened for it, so the fuzzer reaches the verbs behind the lane check.
REFS = st.sampled_from(["LIVE"] * 5 + ["WRONG", "NONE", "RANDOM", "TCP"])
namespaces = st.one_of(
    st.sampled_from([NS, NS, "other", ""]), st.text(max_size=12), st.text(min_size=250, max_size=260)
)
u64 = st.one_of(st.integers(0, 1 << 21), st.integers(0, 2**64 - 1))
headers = st.builds(
    pb.BlockHeader,
    hash=st.one_of(st.sampled_from(KNOWN), st.binary(min_size=16, max_size=16), st.binary(max_size=20)),
    parent=st.sampled_from([b"", KNOWN[0]]) | st.binary(max_size=20),
    codec=st.sampled_from([0, 0, 0]) | enum_values,
    raw_length=st.integers(0, 1 << 17) | u64,
    stored_length=st.integers(0, 1 << 17) | u64,
    crc32c=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(["uint8", "bfloat16", "", "nope"]),
)
descriptors = st.builds(
    lpb.BlockDescriptor,
    index=st.integers(0, 40),
    hash=st.sampled_from(KNOWN) | st.binary(max_size=20),
    offset=u64,
    length=u64,
    crc32c=st.integers(0, 2**32 - 1),
)
get_requests = st.builds(
    pb.GetRequest,
    namespace=namespaces,
    hashes=st.lists(st.sampled_from(KNOWN) | st.binary(max_size=20), max_size=40),
    accepted_codecs=st.lists(enum_values, max_size=3),
    allow_missing=st.booleans(),
)
open_requests = st.builds(
    lpb.OpenLaneRequest,
    kinds=st.lists(st.sampled_from([0, 1, 2, 2]) | enum_values, max_size=4),
    host_id=st.sampled_from(["HOST", "HOST", "", "other-host"]) | st.text(max_size=20),
)


class Binder:
    """Binds placeholder refs of one batch to its live shm lane (and a live tcp lane id)."""

    def __init__(self, live: lpb.OpenLaneResponse, tcp: lpb.OpenLaneResponse, host_id: str):
        self.live, self.tcp, self.host_id = live, tcp, host_id

    def ref(self, which: str, rng: random.Random) -> lpb.LaneRef:
        if which == "LIVE":
            return lpb.LaneRef(lane_id=self.live.lane_id, token=self.live.token)
        if which == "WRONG":
            return lpb.LaneRef(lane_id=self.live.lane_id, token=rng.randbytes(len(self.live.token)))
        if which == "TCP":  # a real lane of the wrong kind
            return lpb.LaneRef(lane_id=self.tcp.lane_id, token=self.tcp.token)
        if which == "RANDOM":
            return lpb.LaneRef(lane_id=rng.randbytes(8).hex(), token=rng.randbytes(16))
        return lpb.LaneRef()


def variants(encoded: bytes, ops: list[tuple[int, int, int]], rng: random.Random) -> list[bytes]:
    return [
        encoded,
        mutate(encoded, ops),
        mutate(encoded, random_ops(rng)),
        mutate(encoded, random_ops(rng)),
        rng.randbytes(rng.randrange(120)),
    ]


def build(method: str, case: Any, b: Binder) -> list[Any]:
    """VARIANTS inputs from one drawn case."""
    if method == "OpenLane":
        msg, ops, seed = case
        rng = random.Random(seed)
        if msg.host_id == "HOST":
            msg.host_id = b.host_id
        return variants(msg.SerializeToString(), ops, rng)
    if method == "CloseLane":
        which, ops, seed = case
        rng = random.Random(seed)
        if which == "LIVE":  # closing the batch's shm lane would starve the other cases: a throwaway lane
            which = "TCP"
        return variants(lpb.CloseLaneRequest(lane=b.ref(which, rng)).SerializeToString(), ops, rng)
    if method == "LaneGet":
        which, req, release, ops, seed = case
        rng = random.Random(seed)
        return variants(
            lpb.LaneGetRequest(lane=b.ref(which, rng), request=req, release=release).SerializeToString(), ops, rng
        )
    which, steps, ops, seed = case  # LanePut: a stream
    rng = random.Random(seed)
    msgs = []
    for i, step in enumerate(steps):
        m = lpb.LanePutRequest(lane=b.ref(which, rng) if i == 0 or rng.random() < 0.1 else None)
        if isinstance(step, lpb.LaneReserve):
            m.reserve.CopyFrom(step)
        elif isinstance(step, lpb.LaneCommit):
            m.commit.CopyFrom(step)
        msgs.append(m.SerializeToString())
    mutated, inserted, dropped = list(msgs), list(msgs), list(msgs)
    if msgs:
        i = rng.randrange(len(msgs))
        mutated[i] = mutate(msgs[i], ops)
        del dropped[i]
    inserted.insert(rng.randrange(len(msgs) + 1), rng.randbytes(rng.randrange(60)))
    return [msgs, mutated, inserted, dropped, [rng.randbytes(rng.randrange(80)) for _ in range(rng.randint(0, 3))]]


steps = st.lists(
    st.one_of(
        st.builds(
            lpb.LaneReserve,
            namespace=namespaces,
            headers=st.lists(headers, max_size=6),
            release=st.lists(st.integers(0, 8) | u64, max_size=3),
        ),
        st.builds(lpb.LaneCommit, grant_id=st.integers(0, 8) | u64, blocks=st.lists(descriptors, max_size=6)),
        st.none(),
    ),
    max_size=6,
)
CASE_STRATEGIES = {
    "OpenLane": st.tuples(open_requests, mutations, seeds),
    "CloseLane": st.tuples(REFS, mutations, seeds),
    "LaneGet": st.tuples(REFS, get_requests, st.lists(st.integers(0, 8) | u64, max_size=3), mutations, seeds),
    "LanePut": st.tuples(REFS, steps, mutations, seeds),
}
credentials = st.sampled_from([TOKEN] * 36 + [None, "wrong-token-for-fuzzing-000", "Basic abc", ""])


def fuzz(node: Node, method: str) -> None:
    counts: Counter = COUNTS.setdefault(method, Counter())
    bad: list[str] = []

    @settings(max_examples=math.ceil(INPUTS / (CASES * VARIANTS)), **SETTINGS)
    @given(st.lists(st.tuples(CASE_STRATEGIES[method], credentials), min_size=CASES, max_size=CASES))
    def batch(drawn: list[tuple[Any, str | None]]) -> None:
        live, tcp = node.open(lpb.LANE_SHM, node.host_id), node.open(lpb.LANE_TCP)
        assert live.kind == lpb.LANE_SHM and tcp.kind == lpb.LANE_TCP, (live.reason, tcp.reason)
        binder = Binder(live, tcp, node.host_id)
        inputs = [(v, token) for case, token in drawn for v in build(method, case, binder)]
        started = time.monotonic()
        results = node.run(method, inputs)
        elapsed = time.monotonic() - started
        for (payload, token), (code, details, out) in zip(inputs, results):
            counts[code.name] += 1
            if code not in EXPECTED[method]:
                bad.append(f"{code.name}: {details!r} for {payload!r:.200} (token {token is not None})")
            if method == "OpenLane" and code == C.OK:  # lanes the fuzz opened: give them back
                node.close_lane(lpb.OpenLaneResponse.FromString(out[0]))
        node.close_lane(live)
        node.close_lane(tcp)
        assert not bad, "\n".join(bad[:5])
        assert elapsed < CALL_TIMEOUT * 3, f"batch took {elapsed:.1f} s"

    started = time.monotonic()
    batch()
    total = sum(counts.values())
    print(f"\n{method}: {total} inputs in {time.monotonic() - started:.1f} s: {dict(counts)}")
    assert total >= INPUTS
    assert node.proc.proc.poll() is None, "the server died"


@pytest.mark.parametrize("method", ["OpenLane", "LaneGet", "LanePut", "CloseLane"])
def test_fuzz_lane_rpcs(node, method):
    fuzz(node, method)


# -- TCP lane framing -------------------------------------------------------------------------------------
def frame(
    kind: int,
    meta: bytes = b"",
    payload: bytes = b"",
    *,
    meta_len: int | None = None,
    data_len: int | None = None,
    magic: bytes = framing.MAGIC,
) -> bytes:
    return (
        framing.HEADER.pack(
            magic, kind, len(meta) if meta_len is None else meta_len, len(payload) if data_len is None else data_len
        )
        + meta
        + payload
    )


def put_frame(rng: random.Random, fault: str) -> tuple[bytes, list[bytes]]:
    """A PUT frame with one structural fault; returns it and the hashes that must never become visible."""
    n_blocks = rng.randint(1, 4)
    hashes = [rng.randbytes(16) for _ in range(n_blocks)]
    blocks = [rng.randbytes(rng.randrange(1, 2048)) for _ in range(n_blocks)]
    hdrs = [
        pb.BlockHeader(hash=h, raw_length=len(d), stored_length=len(d), dtype="uint8") for h, d in zip(hashes, blocks)
    ]
    bad = rng.randrange(n_blocks)
    crcs = [crc32c(d) for d in blocks]
    meta = lpb.TcpPut(namespace=NS, headers=hdrs).SerializeToString()
    if fault == "crc":
        crcs[bad] ^= 1 << rng.randrange(32)
    payload = b"".join(d + framing.CRC.pack(c) for d, c in zip(blocks, crcs))
    if fault == "crc":
        return frame(framing.PUT, meta, payload), hashes[bad : bad + 1]  # only the bad block is refused
    if fault == "length":  # declared payload length differs from what the headers announce: nothing stored
        delta = rng.choice([1, -1, 4, -4, 1 << 40, 2**64 - 1 - len(payload)])
        return frame(framing.PUT, meta, payload, data_len=(len(payload) + delta) % 2**64), hashes
    # "truncate": the connection ends in the middle of the payload: the cut block and later ones never show
    offset = sum(len(d) + 4 for d in blocks[:bad])
    cut = offset + rng.randrange(len(blocks[bad]) + 4)
    return frame(framing.PUT, meta, payload)[: framing.HEADER.size + len(meta) + cut], hashes[bad:]


def frame_case(seed: int, fault: str, ops: list[tuple[int, int, int]]) -> tuple[bytes | None, bytes, list[bytes]]:
    """(hello override or None for the real hello, bytes after it, hashes that must stay invisible)."""
    rng = random.Random(f"{fault}:{seed}")  # per fault: equal seeds of two faults must not share block hashes
    if fault in ("crc", "length", "truncate"):
        data, never = put_frame(rng, fault)
        return None, data, never
    if fault == "garbage":
        return None, rng.randbytes(rng.randrange(200)), []
    if fault == "header":  # truncated header
        return None, frame(rng.choice([framing.PUT, framing.GET]), b"x" * 8)[: rng.randrange(framing.HEADER.size)], []
    if fault == "magic":
        return None, frame(framing.PUT, b"", magic=rng.randbytes(4)), []
    if fault == "kind":
        return (
            None,
            frame(
                rng.choice(
                    [0, framing.HELLO, framing.PUT_REPLY, framing.GET_REPLY, framing.DATA, framing.STATUS, 8, 255]
                ),
                rng.randbytes(rng.randrange(20)),
            ),
            [],
        )
    if fault == "huge":  # huge declared metadata or payload lengths, little or nothing behind them
        kind = rng.choice([framing.PUT, framing.GET, framing.HELLO])
        return (
            None,
            frame(
                kind,
                rng.randbytes(rng.randrange(16)),
                meta_len=rng.choice([framing.MAX_META, framing.MAX_META + 1, 2**32 - 1, rng.randrange(1 << 16)]),
                data_len=rng.choice([0, 2**63, 2**64 - 1, 1 << 30]),
            ),
            [],
        )
    if fault == "getmeta":  # GET with mutated GetRequest metadata or a payload it must not have
        req = pb.GetRequest(
            namespace=rng.choice([NS, "other", ""]),
            hashes=[rng.choice(KNOWN), rng.randbytes(16)],
            allow_missing=rng.random() < 0.5,
        ).SerializeToString()
        return None, frame(framing.GET, mutate(req, ops), b"p" * rng.randrange(2)), []
    if fault == "mutated_put":  # a valid PUT, mutated anywhere: may or may not be valid afterwards
        data, _ = put_frame(rng, "crc")
        return None, mutate(data, ops), []
    # forged hellos
    good = lpb.TcpHello(lane=lpb.LaneRef(lane_id="LIVE", token=b"LIVE")).SerializeToString()
    hello = {
        "hello_token": None,
        "hello_mutated": mutate(good, ops),
        "hello_garbage": rng.randbytes(rng.randrange(64)),
    }[fault]
    tail = frame(framing.PUT, lpb.TcpPut(namespace=NS).SerializeToString())
    return (hello if hello is not None else b"WRONGTOKEN"), tail, []


FAULTS = [
    "crc",
    "length",
    "truncate",
    "garbage",
    "header",
    "magic",
    "kind",
    "huge",
    "getmeta",
    "mutated_put",
    "hello_token",
    "hello_mutated",
    "hello_garbage",
]


def read_until_eof(sock: socket.socket) -> tuple[bool, list[int], str]:
    """Read until the server closes; (closed in time, STATUS codes seen, error)."""
    buf = bytearray()
    deadline = time.monotonic() + SOCK_TIMEOUT
    try:
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    except TimeoutError:
        return False, [], "no EOF within the timeout"
    except ConnectionResetError:
        pass
    codes, i = [], 0
    while i + framing.HEADER.size <= len(buf):
        magic, kind, meta_len, data_len = framing.HEADER.unpack_from(buf, i)
        if magic != framing.MAGIC:
            return True, codes, f"bad frame from the server at {i}"
        meta = bytes(buf[i + framing.HEADER.size : i + framing.HEADER.size + meta_len])
        if kind == framing.STATUS:
            codes.append(lpb.LaneStatus.FromString(meta).code)
        i += framing.HEADER.size + meta_len + data_len
    return True, codes, ""


def run_frame_case(node: Node, case: tuple[int, str, list[tuple[int, int, int]]]) -> tuple[str, list[int], str]:
    seed, fault, ops = case
    hello_override, tail, _ = frame_case(seed, fault, ops)
    opened = node.open(lpb.LANE_TCP)
    assert opened.kind == lpb.LANE_TCP, opened.reason
    ref = lpb.LaneRef(lane_id=opened.lane_id, token=opened.token)
    if hello_override == b"WRONGTOKEN":
        hello = lpb.TcpHello(
            lane=lpb.LaneRef(lane_id=opened.lane_id, token=bytes(len(opened.token)))
        ).SerializeToString()
    elif hello_override is not None:
        hello = hello_override.replace(b"LIVE", opened.lane_id.encode()[:4])
    else:
        hello = lpb.TcpHello(lane=ref).SerializeToString()
    with socket.create_connection(("127.0.0.1", opened.tcp_port), timeout=SOCK_TIMEOUT) as sock:
        try:
            sock.sendall(frame(framing.HELLO, hello))
            if hello_override is None:  # the real hello: wait for its STATUS(OK) before the fuzzed bytes
                head = sock.recv(framing.HEADER.size, socket.MSG_WAITALL)
                _, kind, meta_len, _ = framing.HEADER.unpack(head)
                status = lpb.LaneStatus.FromString(sock.recv(meta_len, socket.MSG_WAITALL) if meta_len else b"")
                assert kind == framing.STATUS and status.code == 0, status
            sock.sendall(tail)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server already closed on us (broken pipe, reset, not connected)
        closed, codes, err = read_until_eof(sock)
    node.close_lane(opened)
    if not closed or err:
        return fault, codes, err or "hang"
    if any(c not in FRAME_CODES for c in codes[:-1]) or (codes and codes[-1] not in FRAME_CODES | {0}):
        return fault, codes, f"unexpected status codes {codes}"
    return fault, codes, ""


FRAME_COUNTS: Counter = Counter()
FRAME_CODES_SEEN: Counter = Counter()


def test_fuzz_tcp_lane_framing(node):
    never: set[bytes] = set()
    bad: list[str] = []

    @settings(max_examples=math.ceil(FRAMES / FRAME_CASES), **SETTINGS)
    @given(st.lists(st.tuples(seeds, st.sampled_from(FAULTS), mutations), min_size=FRAME_CASES, max_size=FRAME_CASES))
    def batch(cases: list[tuple[int, str, list[tuple[int, int, int]]]]) -> None:
        for case in cases:
            never.update(frame_case(*case)[2])
        for fault, codes, err in node.pool.map(lambda c: run_frame_case(node, c), cases):
            FRAME_COUNTS[fault] += 1
            FRAME_CODES_SEEN.update(
                C(next(s for s in C if s.value[0] == c)).name for c in codes if any(s.value[0] == c for s in C)
            )
            if err:
                bad.append(f"{fault}: {err}")

    started = time.monotonic()
    batch()
    total = sum(FRAME_COUNTS.values())
    print(
        f"\nTCP framing: {total} cases in {time.monotonic() - started:.1f} s: {dict(FRAME_COUNTS)}; "
        f"STATUS codes: {dict(FRAME_CODES_SEEN)}"
    )
    assert not bad, f"{len(bad)} bad cases: " + "\n".join(bad[:10])
    assert total >= FRAMES
    assert node.proc.proc.poll() is None, "the server died"
    with Client(node.proc.target, token=TOKEN) as kv:
        hashes = sorted(never)
        visible = [h for h in hashes if kv.lookup(NS, [h])]  # prefix length 1: the block is stored
    assert not visible, f"{len(visible)} blocks from broken frames became visible: {visible[:3]}"
    print(f"checked {len(hashes)} hashes of broken frames: none visible")


def test_node_still_healthy(node):
    """Runs last (file order): health check, normal reads and Stats still work."""
    assert node.proc.proc.poll() is None
    assert healthy(node.proc.target)
    with Client(node.proc.target, token=TOKEN) as kv:
        assert kv.get(NS, KNOWN, allow_missing=True)
        kv.stats()
    print(f"\ninputs: { ({m: sum(c.values()) for m, c in COUNTS.items()}) }, framing: {sum(FRAME_COUNTS.values())}")
