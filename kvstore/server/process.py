"""Start and stop a `kvstore serve` subprocess on a free loopback port (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root: `python -m kvstore` runs this tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def store_process(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> Iterator[tuple[str, subprocess.Popen]]:
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
            if (
                subprocess.run(
                    [sys.executable, "-m", "kvstore", "health", "--target", target, "--timeout", "1"],
                    capture_output=True,
                    cwd=ROOT,
                ).returncode
                == 0
            ):
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
