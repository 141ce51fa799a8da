"""Start and stop a `kvstore serve` subprocess on a free loopback port (demo, benchmarks, tests).

``serving(target)`` asks a plaintext node for its health in this process: a ``kvstore health`` subprocess per
poll cost about 0.3 s of a core each, three or four times per start, beside the starting store on this 2-core VM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstore.free_port import free_port

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root: `python -m kvstore` runs this tree


def serving(target: str, timeout: float = 1.0) -> bool:
    """Whether the plaintext node at ``target`` reports SERVING (False while it cannot be reached)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@contextmanager
def store_process(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yields (target, process) once the node reports SERVING; SIGTERM and wait at exit."""
    target = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--listen",
            target,
            "--metrics-port",
            "0",
            "--log-level",
            "warning",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {proc.returncode}")
            if serving(target):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("kvstore serve did not become healthy")
            time.sleep(0.2)
        yield target, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
