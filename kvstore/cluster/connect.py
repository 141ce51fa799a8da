"""Connecting to Redis: one server or a Redis Cluster, lazily, with backoff after failures.

URLs:

- ``redis://[:password@]HOST:PORT[/db]`` (``rediss://`` for TLS): one server *or* a
  Redis Cluster seed. The first connection asks ``INFO cluster``; with
  ``cluster_enabled:1`` the connector switches to redis-py's ``RedisCluster``
  seeded from that address (it discovers the other masters from CLUSTER SLOTS).
- ``redis+cluster://[:password@]HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://``):
  a Redis Cluster, seeded from every listed node; no detection round trip, and it
  still starts when the first seed is down.

Verbs: ``get()`` returns a connected client or raises ``RedisUnavailable``
(also, without trying, while a backoff after the last failure runs: callers on
a request path never wait for a Redis that just failed); ``failed(err)`` records
a failure (drops the client so the next ``get`` reconnects and re-reads the
cluster topology); ``ok()`` resets the backoff; ``retry_now()`` ends the current one (another
connection just reached Redis); ``close()``.

Timeouts are short (Redis is on the side of the data path, never in it): a
command that cannot finish in ``timeout`` seconds counts as Redis being down.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvstore.cluster.urls import CLUSTER_SCHEMES, SCHEMES, is_redis_url

__all__ = ["REDIS_ERRORS", "RedisClient", "RedisConnector", "RedisUnavailable", "is_redis_url"]

RedisClient = redis.Redis | RedisCluster
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)


class RedisUnavailable(redis.ConnectionError):
    """Redis could not be reached (or was unreachable a moment ago: backing off)."""


class RedisConnector:
    def __init__(self, url: str, *, timeout: float = 1.0, connect_timeout: float = 0.5, max_backoff: float = 2.0):
        scheme = url.split("://", 1)[0].lower()
        if scheme not in SCHEMES:
            raise ValueError(f"not a Redis URL: {url!r} (expected redis://HOST:PORT, rediss:// or redis+cluster://)")
        self.url, self.timeout, self.connect_timeout, self.max_backoff = url, timeout, connect_timeout, max_backoff
        self.force_cluster = scheme in CLUSTER_SCHEMES
        self.mode: str | None = None  # "single" or "cluster" once connected
        self._client: RedisClient | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = 0.0
        self.last_error = ""

    # -- verbs ------------------------------------------------------------------------------
    def get(self) -> RedisClient:
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._retry_at:
                raise RedisUnavailable(f"Redis at {self.safe_url} unavailable ({self.last_error}); retrying later")
            try:
                self._client = self._connect()
            except REDIS_ERRORS as err:
                self._note_failure(err)
                raise RedisUnavailable(f"Redis at {self.safe_url}: {err}") from err
            return self._client

    def failed(self, err: BaseException) -> None:
        if isinstance(err, RedisUnavailable):
            return  # raised by get(): already recorded, and a backoff must not extend itself
        with self._lock:
            self._note_failure(err)
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    def ok(self) -> None:
        self._backoff = 0.0

    def retry_now(self) -> None:
        """Someone else just reached this Redis: end the backoff."""
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return self._client is not None or time.monotonic() >= self._retry_at

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    @property
    def safe_url(self) -> str:
        """The URL without its password, for logs and stats."""
        parts = urlsplit(self.url.replace("+cluster", "", 1))
        netloc = parts.netloc.rpartition("@")[2]
        return f"{self.url.split('://', 1)[0]}://{netloc}{parts.path}"

    # -- internals -----------------------------------------------------------------------------
    def _note_failure(self, err: BaseException) -> None:
        self.last_error = f"{type(err).__name__}: {err}"
        self._backoff = min(self.max_backoff, max(0.05, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff

    def _options(self) -> dict[str, Any]:
        return {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.connect_timeout,
            "retry": Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
        }

    def _connect(self) -> RedisClient:
        if self.force_cluster:
            return self._cluster_from_seeds()
        single = redis.Redis.from_url(self.url, **self._options())
        try:
            enabled = int(single.info("cluster").get("cluster_enabled", 0))
        except BaseException:
            single.close()
            raise
        if not enabled:
            self.mode = "single"
            return single
        single.close()
        self.mode = "cluster"
        return RedisCluster.from_url(self.url, **self._options())

    def _cluster_from_seeds(self) -> RedisCluster:
        scheme, rest = self.url.split("://", 1)
        userinfo, _, hosts = rest.rpartition("@")
        hosts = hosts.split("/", 1)[0]
        seeds = []
        for hostport in hosts.split(","):
            host, _, port = hostport.strip().rpartition(":")
            # redis-py declares ClusterNode.__init__ without annotations
            seeds.append(ClusterNode(host.strip("[]") or "127.0.0.1", int(port or 6379)))  # type: ignore[no-untyped-call]
        kwargs = self._options()
        if userinfo:
            user, _, password = userinfo.partition(":")
            kwargs.update({"username": user or None, "password": password or None})
        if scheme.startswith("rediss"):
            kwargs["ssl"] = True
        self.mode = "cluster"
        return RedisCluster(startup_nodes=seeds, **kwargs)


def _close_quietly(client: RedisClient) -> None:
    try:
        client.close()
    except REDIS_ERRORS:
        pass
