"""``KVStoreHiCacheStorage``: kvstore behind SGLang's hierarchical cache (a ``HiCacheStorage`` backend).

Loaded by SGLang's ``dynamic`` backend factory as ``KVStoreHiCacheStorage(storage_config, kwargs)``; the
``extra_config`` it is given holds the factory's own keys (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``) and this backend's:

- ``target`` (required): ``HOST:PORT`` of a ``kvstore serve``, or ``redis://...`` for a cluster;
- ``namespace`` (default ``sglang``), ``token``, ``tls_ca``/``tls_cert``/``tls_key``, ``lane``, ``codec``,
  ``timeout``, ``retries``: as for ``kvstore.client.Client``; ``verify`` (default true): check each page's
  CRC32C before SGLang may use it; ``warm_clients`` (default 2, 0 for none): clients warmed up at registration.

Verbs (SGLang's threads call them concurrently: each thread has its own client):

- ``register_mem_pool_host(pool)``: as SGLang's cache controller calls it at start; also warms up
  ``warm_clients`` clients (default 2, ``extra_config``) for the threads that will move pages
  (``Client.warm_up``: each one's lane, and the copy and CRC32C kernels of the process), so that their first
  Get and Put neither open a lane nor wait on a compile (``bench.sglang_first``: 10.5 -> 4.2 ms, 79.6 -> 48.8).

- ``batch_exists(keys)``: one Lookup, the number of leading pages the store holds; 0 when it cannot be asked.
- ``batch_get_v1(keys, host_indices)``: one Get of the pages straight into SGLang's host pool pages
  (``get_page_buffer_meta``); per page True when it arrived intact. A page missing, a CRC32C mismatch or the
  store unreachable gives False (for every page of a failed Get), and SGLang recomputes from the first False.
- ``batch_set_v1(keys, host_indices)``: one Put of the pages, read in place, chained onto the page before the
  batch (``extra_info.prefix_keys``); per page True when stored or already there.
- ``get``/``set``/``batch_get``/``batch_set``/``exists``: SGLang's older tensor verbs (without ``interface_v1``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.client import Client
from kvstore.integrations.client_options import check_client_options
from kvstore.integrations.sglang.pages import PageKeys, fingerprint, page_segments

log = logging.getLogger(__name__)

FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
# SGLang's cache controller moves pages on two threads (prefetch_io_aux_func's Gets, backup_thread_func's Puts); its
# prefetch thread only looks up, which needs no lane
WARM_CLIENTS = 2
CLIENT_KEYS = ("token", "tls_ca", "tls_cert", "tls_key", "lane", "codec")


class KVStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        extra = dict(storage_config.extra_config or {})
        if not extra.get("target"):
            raise ValueError('kvstore HiCache backend: extra_config needs "target" (HOST:PORT or redis://...)')
        known = FACTORY_KEYS | {"target", "namespace", "verify", "timeout", "retries", "warm_clients", *CLIENT_KEYS}
        unknown = sorted(set(extra) - known)
        if unknown:
            log.warning("kvstore HiCache backend: ignoring unknown extra_config keys %s", unknown)
        self.config = storage_config
        self.target = str(extra["target"])
        self.namespace = str(extra.get("namespace") or "sglang")
        self.verify = str(extra.get("verify", "true")).lower() not in ("0", "false", "no", "off")
        self._client_args: dict[str, Any] = {k: extra[k] for k in CLIENT_KEYS if extra.get(k) is not None}
        for key, kind in (("timeout", float), ("retries", int)):
            if extra.get(key) is not None:
                try:
                    self._client_args[key] = kind(extra[key])
                except ValueError as err:
                    raise ValueError(f"kvstore HiCache backend: {key}: {err}") from None
        args = self._client_args
        check_client_options(
            "kvstore HiCache backend", target=self.target, timeout=args.get("timeout"), retries=args.get("retries"),
            lane=str(args.get("lane", "auto")), codec=str(args.get("codec", "none")),
        )  # fmt: skip
        self._keys = PageKeys(fingerprint(storage_config, None))
        self._local = threading.local()
        self._clients: list[Client] = []
        self._warm: list[Client] = []  # warmed at registration, each taken by the first thread that moves pages
        try:
            self.warm_clients = int(extra["warm_clients"]) if extra.get("warm_clients") is not None else WARM_CLIENTS
        except ValueError as err:
            raise ValueError(f"kvstore HiCache backend: warm_clients: {err}") from None
        if self.warm_clients < 0:
            raise ValueError(f"kvstore HiCache backend: warm_clients must be >= 0; got {self.warm_clients}")
        self._lock = threading.Lock()
        self.mem_pool_host: Any = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._keys = PageKeys(fingerprint(self.config, mem_pool_host))  # the pool's geometry is part of the bytes
        self._warm_up()

    # -- the zero-copy verbs (interface_v1) ----------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        try:
            return int(self._client(moves_pages=False).lookup(self.namespace, self._keys.hashes(keys)))
        except Exception as err:  # unreachable: nothing is cached, as far as SGLang can tell
            self._drop_client(err, "Lookup")
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        try:
            pages = self._pages(keys, host_indices)
            got = self._client().get(
                self.namespace, self._keys.hashes(keys), out=pages, allow_missing=True, verify=self.verify
            )
        except Exception as err:  # unreachable, a CRC32C mismatch, lost mid-Get: SGLang recomputes these pages
            self._drop_client(err, "Get")
            return [False] * len(keys)
        return [block is not None for block in got]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = self._keys.hash(prefix[-1]) if prefix else None
        try:
            pages = self._pages(keys, host_indices)
            results = self._client().put(self.namespace, self._keys.hashes(keys), pages, parent=parent)
        except Exception as err:  # a save is best effort: a failed one is a later miss
            self._drop_client(err, "Put")
            return [False] * len(keys)
        return [r.ok for r in results]

    # -- the tensor verbs --------------------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("kvstore HiCache backend: batch_get needs one target tensor per key")
        try:
            got = self._client().get(
                self.namespace, self._keys.hashes(keys), out=list(target_locations), allow_missing=True,
                verify=self.verify,
            )  # fmt: skip
        except Exception as err:
            self._drop_client(err, "Get")
            return [None] * len(keys)
        return [t if block is not None else None for t, block in zip(target_locations, got)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("kvstore HiCache backend: batch_set needs one value tensor per key")
        try:
            results = self._client().put(
                self.namespace, self._keys.hashes(keys), [v.contiguous() for v in values], chained=False
            )
        except Exception as err:
            self._drop_client(err, "Put")
            return False
        return all(r.ok for r in results)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Closes this backend's clients (the store's blocks stay: other engines share them)."""
        with self._lock:
            clients, self._clients, self._warm = self._clients, [], []
        for client in clients:
            client.close()
        self._local = threading.local()

    close = clear

    # -- helpers -----------------------------------------------------------------------------------------
    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> list[Any]:
        if self.mem_pool_host is None:
            raise RuntimeError("kvstore HiCache backend: no host memory pool registered")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return page_segments(ptrs, sizes, len(keys))

    def _warm_up(self) -> None:
        """``warm_clients`` clients with their lanes open and the process's kernels compiled, before SGLang's first
        request (see the module docstring). A store down now raises nothing: a client opens its lane at a later
        call; any other error is logged, and the threads make their own clients."""
        with self._lock:
            wanted = self.warm_clients - len(self._warm)  # registered again: only what is missing
        for _ in range(wanted):
            client = Client(self.target, **self._client_args)
            try:
                client.warm_up()
            except Exception as err:
                log.warning("kvstore HiCache backend: warm-up failed: %s", err)
                client.close()
                return
            with self._lock:
                self._clients.append(client)
                self._warm.append(client)

    def _client(self, moves_pages: bool = True) -> Client:
        """This thread's client: a warmed one for a thread that moves pages while any is left, else a new one."""
        client: Client | None = getattr(self._local, "client", None)
        if client is None:
            with self._lock:
                client = self._warm.pop() if moves_pages and self._warm else None
            if client is None:
                client = Client(self.target, **self._client_args)
                with self._lock:
                    self._clients.append(client)
            self._local.client = client
        return client

    def _drop_client(self, err: Exception, verb: str) -> None:
        log.warning("kvstore HiCache backend: %s failed: %s", verb, err)
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            with self._lock:
                if client in self._clients:
                    self._clients.remove(client)
            try:
                client.close()
            except Exception:
                pass
