"""The live ``kvstore serve`` the lane fuzzers run against (no tests here): ``node`` (a module-scoped fixture:
the server with a tenant token, small limits, shm and tcp lanes and a few known blocks; at teardown it fails
the module if the server logged a traceback), ``Node`` (raw KVStoreLanes calls, sync and asyncio) and
``healthy(target)`` (``kvstore health``). Used by tests/test_fuzz_lanes.py and tests/test_fuzz_tcp_framing.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, Phase

from kvstore.client import Client
from kvstore.v1 import lanes_pb2 as lpb
from tests.conftest import ROOT, ServerProcess
from tests.test_fuzz import _metadata

CONCURRENCY = 16
CALL_TIMEOUT = 10.0
TOKEN = "fuzzing-lanes-token-000000000"
NS = "fzl"
KNOWN = [bytes([0x80 | i]) * 16 for i in range(8)]
C = grpc.StatusCode
BASE = {C.OK, C.INVALID_ARGUMENT, C.UNAUTHENTICATED, C.PERMISSION_DENIED, C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED}
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
