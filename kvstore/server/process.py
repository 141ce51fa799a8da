"""Start and stop a `kvstore serve` subprocess on a free loopback port (demo, benchmarks, tests).

``serving(target)`` asks a plaintext node for its health in this process: a ``kvstore health`` subprocess per
poll cost about 0.3 s of a core each, three or four times per start, beside the starting store on this 2-core VM.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvstore import config
from kvstore.free_port import free_port
from kvstore.lanes.shm_region import sweep

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root: `python -m kvstore` runs this tree


def shm_dir_of(args: Sequence[str], env: Mapping[str, str]) -> str:
    """The ``--shm-dir`` a ``kvstore serve`` with these arguments and environment uses, as its own config loader
    reads it (flag, ``KVSTORE_SHM_DIR``, ``--config`` file, default)."""
    parser = argparse.ArgumentParser(add_help=False)
    config.add_arguments(parser)
    flags, _ = parser.parse_known_args(list(args))  # the serve command's other flags (--listen, ...) pass by
    return config.load(flags, dict(env)).shm_dir


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
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0, stop_seconds: float = 30.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yields (target, process) once the node reports SERVING; SIGTERM and wait at exit. A store still running
    ``stop_seconds`` later is killed, and what it left in its ``--shm-dir`` (its shared DRAM arena, up to ``--dram``
    of memory, and its lanes' files) is swept then, not at the next store's start."""
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
            proc.wait(stop_seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            swept = sweep(shm_dir_of(args, {**os.environ, **(env or {})}))
            log.warning(
                "kvstore serve (pid %d) did not stop in %.0f s: killed, %d files swept", proc.pid, stop_seconds, swept
            )
