"""Prometheus metrics: request latency histograms, bytes in/out, and store gauges.

Store state (bytes and blocks per tier, hits, evictions, ...) is read from
``BlockStore.stats()`` at scrape time by a custom collector, so the data path
pays nothing for it; only per-RPC latency and byte counters are updated inline.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _StoreCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]], extra: Callable[[], dict[str, float]]):
        self._stats, self._extra = stats, extra

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "used_bytes": GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes held in a tier", labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity of a tier", labels=["tier"]),
            "blocks": GaugeMetricFamily("kvstore_tier_blocks", "Blocks with a copy in a tier", labels=["tier"]),
            "degraded": GaugeMetricFamily("kvstore_tier_degraded", "1 when the tier has an I/O fault", labels=["tier"]),
        }
        counters = {
            "hits": CounterMetricFamily("kvstore_tier_hits", "Blocks served from a tier", labels=["tier"]),
            "evictions": CounterMetricFamily("kvstore_tier_evictions", "Copies evicted from a tier", labels=["tier"]),
            "demotions": CounterMetricFamily(
                "kvstore_tier_demotions", "Copies demoted to the next tier", labels=["tier"]
            ),
            "promotions": CounterMetricFamily(
                "kvstore_tier_promotions", "Copies promoted into a tier", labels=["tier"]
            ),
            "not_admitted": CounterMetricFamily(
                "kvstore_tier_not_admitted",
                "Evicted copies dropped instead of demoted: used too few times for the tier below",
                labels=["tier"],
            ),
        }
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {**gauges, **counters}
        for tier in s["tiers"]:
            for key, family in families.items():
                family.add_metric([tier["name"]], float(tier[key]))
        yield from gauges.values()
        yield from counters.values()
        yield GaugeMetricFamily("kvstore_blocks", "Blocks in the index", value=s["blocks"])
        yield GaugeMetricFamily("kvstore_index_bytes", "Bytes of the index columns", value=s["index_bytes"])
        yield CounterMetricFamily("kvstore_lookups", "Lookup calls", value=s["lookups"])
        yield CounterMetricFamily(
            "kvstore_lookup_hashes", "Hashes asked in Lookup calls", value=s["lookup_hits"] + s["lookup_misses"]
        )
        for key in ("lookup_hits", "lookup_misses", "puts", "already_present", "rejected", "corrupt"):
            yield CounterMetricFamily(f"kvstore_{key}", f"Blocks: {key.replace('_', ' ')}", value=s[key])
        queued = s.get("queued_promotions", {})
        for key in ("candidates", "promoted", "skipped"):
            yield CounterMetricFamily(
                f"kvstore_share_nvme_promotions_{key}",
                f"Blocks --share-nvme clients read from NVMe themselves again, to promote in the background: {key}",
                value=queued.get(key, 0),
            )
        for key, value in self._extra().items():
            yield GaugeMetricFamily(f"kvstore_{key}", key.replace("_", " "), value=value)


class Metrics:
    """Per-process metrics; ``registry`` is served by ``start_http``."""

    def __init__(self, stats: Callable[[], dict[str, Any]] | None = None):
        self.registry = CollectorRegistry()
        self._latency = Histogram(
            "kvstore_rpc_seconds", "RPC latency", ["method", "code"], buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self._bytes_in = Counter("kvstore_bytes_in", "Payload bytes received", registry=self.registry)
        self._bytes_out = Counter("kvstore_bytes_out", "Payload bytes sent", registry=self.registry)
        self._extra: dict[str, float] = {}
        self._lock = threading.Lock()
        self.total_in = 0
        self.total_out = 0
        if stats is not None:
            self.registry.register(_StoreCollector(stats, self.counters))

    @contextlib.contextmanager
    def rpc(self, method: str, context: Any = None) -> Iterator[None]:
        start = time.perf_counter()
        code = "OK"
        try:
            yield
        except BaseException:
            code = "ERROR"
            if context is not None and hasattr(context, "code") and context.code() is not None:
                code = context.code().name
            raise
        finally:
            self._latency.labels(method, code).observe(time.perf_counter() - start)

    def bytes_in(self, n: int) -> None:
        self._bytes_in.inc(n)
        with self._lock:
            self.total_in += n

    def bytes_out(self, n: int) -> None:
        self._bytes_out.inc(n)
        with self._lock:
            self.total_out += n

    def set(self, name: str, value: float) -> None:
        """A named gauge shown in Stats.counters and on /metrics (lanes, codecs, ...)."""
        with self._lock:
            self._extra[name] = value

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._extra[name] = self._extra.get(name, 0.0) + value

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._extra)

    def start_http(self, port: int, addr: str = "0.0.0.0", token: str | None = None) -> Any:
        """Serve /metrics on a daemon thread; with ``token`` every scrape must send it as a bearer token.

        Returns (server, thread) like prometheus_client's ``start_http_server``.
        """
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client import make_wsgi_app
        from prometheus_client.exposition import ThreadingWSGIServer

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

        app = make_wsgi_app(self.registry)
        httpd = make_server(
            addr, port, app if token is None else _bearer_only(app, token), ThreadingWSGIServer, handler_class=Quiet
        )
        thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-http")
        thread.start()
        return httpd, thread


def _bearer_only(app: Callable[..., Any], token: str) -> Callable[..., Any]:
    """A WSGI app that answers 401 unless the request carries ``Authorization: Bearer <token>``."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"a bearer token is required for /metrics\n"]

    return guarded
