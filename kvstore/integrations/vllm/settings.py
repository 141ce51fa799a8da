"""The connector's settings: the keys of vLLM's ``kv_connector_extra_config``.

- ``Settings.from_extra(extra) -> Settings``: every key checked (an unknown key is an error naming the known
  ones, so a typo never silently runs with a default).
- ``Settings.client()``: a ``kvstore.client.Client`` for them (``redis://`` targets give a cluster client).
- ``ClientSlot(factory)``: one lazily built client; ``call(fn)`` runs ``fn(client)`` and, when it raises,
  drops the client so the next call builds a fresh one (a restarted store is reached at once instead of
  after gRPC's reconnect backoff, and a broken lane is renegotiated).

Keys (all optional except ``target``):

==================  ==========================================================================================
``target``          ``HOST:PORT`` of one ``kvstore serve``, or ``redis://HOST:PORT`` for a cluster
``namespace``       tenant namespace (default ``vllm``); a request's ``cache_salt`` is appended to it
``token``           tenant bearer token (``--tenants`` on the server)
``tls_ca``          CA bundle that verifies the server; ``tls_cert``/``tls_key``: client certificate (mTLS)
``lane``            data lane: ``auto`` (default), ``shm``, ``tcp``, ``grpc``, ``cuda_ipc``
``codec``           ``none`` (default), a codec name or ``auto`` (kvstore.codecs)
``timeout``         seconds per store call (default 10)
``retries``         retries of UNAVAILABLE per call (default 1: a store that is down costs one fast retry)
``load_chunk``      blocks per Get while loading (default 0: about 90 MiB a Get on a CPU cache, 16 on a GPU one)
``load_streams``    Gets in flight while loading, one client each (default 2)
``save_chunk``      blocks per Put while saving (default 16)
``staging``         a GPU cache's staging buffers: ``auto``/``host`` (default: pinned host memory, filled over the
                    host lanes) or ``device`` (device memory: device to device over the cuda_ipc lane where the
                    store shares the GPU); docs/vllm.md, "A CUDA KV cache"
``model_id``        name of the model in the fingerprint (default: vLLM's ``model``)
``stats_path``      a directory: each side rewrites its counters there (``scheduler.json``, ``worker.json``)
``on_load_error``   ``recompute`` (default: sets vLLM's ``kv_load_failure_policy`` so) or ``fail`` (vLLM's own)
``load_planner``    how many hit blocks to load: ``cost`` (default: from measured costs, ``planning``), ``all`` or ``module:name``
``verify_loads``    ``true`` (default): CRC32C every loaded block here too; ``false``: trust the store's checks (on
                    every write and every NVMe read), which leaves DRAM hits unchecked end to end
``huge_pages``      ``true`` (default): ask the kernel for transparent huge pages under a CPU KV cache at register
                    (the store's writes into it are faster); ``false``: leave its pages as torch made them
==================  ==========================================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from kvstore.integrations.client_options import check_client_options

T = TypeVar("T")

_ALIASES = {"tls_ca_file": "tls_ca", "tls_cert_file": "tls_cert", "tls_key_file": "tls_key"}
# Where a device cache's blocks wait between the store and the cache ("auto" is "host"; on a host cache "auto" moves
# blocks in place and "host"/"device" stage them through host memory, the staged path without a GPU, for tests).
STAGINGS = ("auto", "host", "device")


@dataclass(frozen=True)
class Settings:
    target: str
    namespace: str = "vllm"
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    lane: str = "auto"
    codec: str = "none"
    timeout: float = 10.0
    retries: int = 1
    load_chunk: int = 0
    load_streams: int = 2
    save_chunk: int = 16
    model_id: str | None = None
    stats_path: str | None = None
    load_planner: str | None = "cost"
    on_load_error: str = "recompute"
    verify_loads: bool = True
    staging: str = "auto"
    huge_pages: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        given = {_ALIASES.get(k, k): v for k, v in (extra or {}).items()}
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(
                f"kvstore connector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        if not given.get("target"):
            raise ValueError('kvstore connector: kv_connector_extra_config needs "target" (HOST:PORT or redis://...)')
        values: dict[str, Any] = {}
        for name, value in given.items():
            kind = known[name].type
            try:
                if value is None:
                    values[name] = None
                elif kind in ("int", int):
                    values[name] = int(value)
                elif kind in ("float", float):
                    values[name] = float(value)
                elif kind in ("bool", bool):
                    values[name] = _flag(name, value)
                else:
                    values[name] = str(value)
            except ValueError as err:
                raise ValueError(f"kvstore connector: {name}: {err}") from None
        settings = cls(**values)
        check_client_options(
            "kvstore connector", target=settings.target, timeout=settings.timeout, retries=settings.retries,
            lane=settings.lane, codec=settings.codec,
        )  # fmt: skip
        if settings.on_load_error not in ("recompute", "fail"):
            raise ValueError(
                f"kvstore connector: on_load_error must be recompute or fail, not {settings.on_load_error!r}"
            )
        if settings.staging not in STAGINGS:
            raise ValueError(
                f"kvstore connector: staging must be one of {', '.join(STAGINGS)}, not {settings.staging!r}"
            )
        if settings.load_chunk < 0 or settings.save_chunk < 1 or settings.load_streams < 1:
            raise ValueError("kvstore connector: load_streams and save_chunk must be >= 1, load_chunk >= 0 (0: auto)")
        return settings

    def client(self) -> Any:
        from kvstore.client import Client

        return Client(
            self.target,
            token=self.token,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            timeout=self.timeout,
            retries=self.retries,
            lane=self.lane,
            codec=self.codec,
        )


class ClientSlot:
    def __init__(self, factory: Callable[[], Any]):
        self._factory = factory
        self.client: Any = None

    def call(self, fn: Callable[[Any], T]) -> T:
        if self.client is None:
            self.client = self._factory()
        try:
            return fn(self.client)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"kvstore connector: {name} must be true or false, not {value!r}")
