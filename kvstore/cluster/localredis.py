"""Throwaway Redis servers on loopback for tests and benchmarks: one server, or a 3-master Redis Cluster.

    with LocalRedis() as r:              # r.url == "redis://127.0.0.1:<port>"
        r.stop(); r.start()              # same port, empty again (no persistence)
    with LocalRedisCluster(masters=3) as c:   # c.url seeds the cluster
        ...

Both need the ``redis-server`` (and for the cluster ``redis-cli``) executables;
``RedisNotAvailable`` says why when they are missing or do not come up.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.free_port import free_port


class RedisNotAvailable(RuntimeError):
    pass


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import random

    draw = random.SystemRandom()  # not the shared generator, which test runners seed alike in every worker
    for _ in range(200):
        port = draw.randint(10000, 22000)  # both below the ephemeral range, as free_port's
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RedisNotAvailable("no free port pair (port, port + 10000) for a cluster node")


def _exe(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisNotAvailable(f"{name} not found on PATH (Debian: apt-get install redis-server redis-tools)")
    return path


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RedisNotAvailable(f"redis-server on port {port} did not start within {timeout:.0f}s")


class LocalRedis:
    """One redis-server without persistence; ``stop()``/``start()`` keep the port."""

    def __init__(self, port: int | None = None, *, extra: tuple[str, ...] = (), workdir: str | None = None):
        self.exe = _exe("redis-server")
        self.port = port or free_port()
        self.extra = extra
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvstore-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> LocalRedis:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port, 10)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalRedisCluster:
    """``masters`` cluster-enabled redis-servers joined with ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, masters: int = 3, timeout: float = 20.0):
        self.cli = _exe("redis-cli")
        self.root = Path(tempfile.mkdtemp(prefix="kvstore-rcluster-"))
        self.nodes = [
            LocalRedis(
                _free_cluster_port(),
                extra=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),
                workdir=str(self.root / str(i)),
            )
            for i in range(masters)
        ]
        self.timeout = timeout

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def seeds_url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> LocalRedisCluster:
        for node in self.nodes:
            node.workdir.mkdir(parents=True, exist_ok=True)
            node.start()
        create = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=self.timeout,
        )
        if create.returncode != 0:
            self.close()
            raise RedisNotAvailable(f"redis-cli --cluster create failed: {create.stdout[-500:]} {create.stderr[-500:]}")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            states = [
                subprocess.run([self.cli, "-p", str(n.port), "cluster", "info"], capture_output=True, text=True).stdout
                for n in self.nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                return self
            time.sleep(0.1)
        self.close()
        raise RedisNotAvailable(f"Redis Cluster did not reach cluster_state:ok within {self.timeout:.0f}s")

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
