"""Fuzzing the bulk TCP lane's framing against a live `kvstore serve` (tests/fuzz_lanes_node.py).

for each case a real tcp lane is opened (valid token) and a connection sends random,
mutated or structurally broken frames (garbage, truncated headers, huge declared metadata/payload lengths,
wrong CRCs, unknown kinds, payload length mismatches), or opens with a forged/garbled hello. Promises: the
server closes every connection (EOF) within a short timeout after the client stops sending, any STATUS frame
it sends carries a code from the expected set, no hash of a block whose frame was broken becomes visible
(checked with a normal Client lookup), and the node stays healthy (`kvstore health`).

``KVSTORE_FUZZ_FRAMES`` sets the framing cases (default 1,000); hypothesis runs derandomized, so runs are
deterministic.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.lanes import framing
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import lanes_pb2 as lpb
from tests.fuzz_lanes_node import BASE, KNOWN, NS, SETTINGS, TOKEN, C, Node, healthy, node
from tests.test_fuzz import mutate, mutations, seeds

FRAMES = int(os.environ.get("KVSTORE_FUZZ_FRAMES", "1000"))
FRAME_CASES = 25
SOCK_TIMEOUT = 8.0
FRAME_CODES = {c.value[0] for c in BASE | {C.NOT_FOUND}} - {0}
_ = node  # the fixture, imported for pytest


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


def test_node_still_healthy_after_framing(node):
    """Runs last (file order): health check and normal reads still work."""
    assert node.proc.proc.poll() is None
    assert healthy(node.proc.target)
    with Client(node.proc.target, token=TOKEN) as kv:
        assert kv.get(NS, KNOWN, allow_missing=True)
