"""Tenants: who may call the store, and which namespaces each one reaches (DESIGN 2.4, 7).

The tenants file (``--tenants FILE``) is YAML, either a plain list of tenants
or a mapping with the list under ``tenants`` and node-wide settings beside it::

    shared_namespaces: [public-prompts]     # every tenant may use these
    shared_quota: 1GiB                       # bytes all shared namespaces may hold (default: none)
    tenants:
      - name: team-a
        token: "a long random secret"        # or token_sha256: <hex of SHA-256 of the token>
        cert_names: [team-a-worker]          # optional (mTLS): client certificate CN/SAN values of this tenant
        namespaces: [team-a, "team-a/*"]     # exact names; a trailing * grants every name with that prefix
        quota: 512MiB                        # optional: bytes this tenant's namespaces may hold
        max_streams: 4                       # optional: concurrent Put/Get streams
      - name: ops
        token_sha256: 9f86d08...
        namespaces: []
        admin: true                          # may read whole-node Stats

Promises:

- ``TenantRegistry.authenticate(token) -> Tenant | None`` compares the SHA-256
  of the presented token with every tenant's digest using
  ``hmac.compare_digest`` and never stops early, so the time taken does not
  depend on which tenant (if any) matched. Tokens are kept only as digests
  and never appear in logs, reprs or error messages.
- ``Tenant.allows(namespace)``: exact grants, prefix grants (``"x/*"``) and
  the file's shared namespaces. Nothing else: there is no implicit access.
- ``TenantRegistry.bucket_of(namespace)``: the quota bucket a namespace's bytes
  are charged to: the one non-admin tenant granted it, or ``SHARED`` when
  several tenants (or every tenant, through ``shared_namespaces``) reach it.
- The file is checked whole on load (unknown keys, duplicate names or tokens,
  short tokens, malformed namespaces are errors naming the entry); a reload
  that fails keeps the previous registry.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstore.server import validate
from kvstore.sizes import parse_size

log = logging.getLogger(__name__)

SHARED = "(shared)"
MIN_TOKEN_CHARS = 16
_TENANT_KEYS = {"name", "token", "token_sha256", "cert_names", "namespaces", "admin", "quota", "max_streams"}
_FILE_KEYS = {"tenants", "shared_namespaces", "shared_quota"}


def token_digest(token: str) -> bytes:
    """SHA-256 of a bearer token: the only form in which tokens are kept in memory."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Grants:
    """Namespaces reachable by one tenant: exact names and name prefixes."""

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    def allows(self, namespace: str) -> bool:
        return namespace in self.exact or any(namespace.startswith(p) for p in self.prefixes)

    @staticmethod
    def parse(entries: Iterable[str], where: str) -> Grants:
        exact: set[str] = set()
        prefixes: list[str] = []
        for raw in entries:
            if not isinstance(raw, str):
                raise ValueError(f"{where}: namespace {raw!r} is not a string")
            name = raw[:-1] if raw.endswith("*") else raw
            try:
                validate.namespace(name)
            except validate.InvalidRequest as err:
                raise ValueError(f"{where}: namespace {raw!r}: {err}") from None
            if raw.endswith("*"):
                prefixes.append(name)
            else:
                exact.add(name)
        return Grants(frozenset(exact), tuple(prefixes))


@dataclass(frozen=True)
class Tenant:
    name: str
    digest: bytes = field(repr=False)
    grants: Grants
    admin: bool = False
    quota_bytes: int | None = None  # None: the node default (--tenant-quota)
    max_streams: int | None = None  # None: the node default (--tenant-streams)
    shared: Grants = Grants()  # the file's shared namespaces, open to every tenant
    cert_names: frozenset[str] = frozenset()  # client certificate CN/SAN values that identify this tenant (mTLS)

    def allows(self, namespace: str) -> bool:
        return self.grants.allows(namespace) or self.shared.allows(namespace)


@dataclass(frozen=True)
class TenantRegistry:
    tenants: tuple[Tenant, ...]
    shared: Grants = Grants()
    shared_quota_bytes: int | None = None
    source: str = ""
    _buckets: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    _by_name: dict[str, Tenant] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name.update((t.name, t) for t in self.tenants)

    # -- authentication ------------------------------------------------------------
    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant holding `token`, in time independent of which tenant it is."""
        if not token:
            return None
        presented = token_digest(token)
        found: Tenant | None = None
        for tenant in self.tenants:  # no early exit: every digest is compared
            if hmac.compare_digest(presented, tenant.digest):
                found = tenant
        return found

    @property
    def by_certificate(self) -> bool:
        """Whether some tenant is identified by its client certificate."""
        return any(t.cert_names for t in self.tenants)

    def authenticate_certificate(self, names: Iterable[str]) -> Tenant | None:
        """The one tenant that lists any of a verified client certificate's names (CN and SANs); None when no
        tenant does or when they point at different tenants."""
        presented = set(names)
        found = {t.name: t for t in self.tenants if t.cert_names & presented}
        return next(iter(found.values())) if len(found) == 1 else None

    # -- quota buckets ---------------------------------------------------------------
    def bucket_of(self, namespace: str) -> str:
        """Who is charged for bytes stored in `namespace` (a tenant name or SHARED)."""
        bucket = self._buckets.get(namespace)
        if bucket is None:
            if self.shared.allows(namespace):
                bucket = SHARED
            else:
                owners = [t.name for t in self.tenants if not t.admin and t.grants.allows(namespace)]
                bucket = owners[0] if len(owners) == 1 else SHARED
            if len(self._buckets) < 65536:  # namespaces per node are bounded by the index (uint16)
                self._buckets[namespace] = bucket
        return bucket

    def quota_of(self, bucket: str, default: int | None) -> int | None:
        """Byte quota of a bucket; None or 0 means unlimited."""
        if bucket == SHARED:
            return self.shared_quota_bytes
        tenant = self._by_name.get(bucket)
        return tenant.quota_bytes if tenant is not None and tenant.quota_bytes is not None else default

    # -- loading ----------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> TenantRegistry:
        text = Path(path).read_text()
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML: {err}") from None
        return cls.parse(doc, source=str(path))

    @classmethod
    def parse(cls, doc: Any, source: str = "<tenants>") -> TenantRegistry:
        if isinstance(doc, list):
            doc = {"tenants": doc}
        if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list):
            raise ValueError(f"{source}: expected a list of tenants, or a mapping with a 'tenants' list")
        unknown = set(doc) - _FILE_KEYS
        if unknown:
            raise ValueError(f"{source}: unknown keys {sorted(unknown)}; known: {sorted(_FILE_KEYS)}")
        shared = Grants.parse(doc.get("shared_namespaces") or [], f"{source}: shared_namespaces")
        shared_quota = _size(doc.get("shared_quota"), f"{source}: shared_quota")
        tenants = tuple(_tenant(entry, i, shared, source) for i, entry in enumerate(doc["tenants"]))
        if not tenants:
            raise ValueError(f"{source}: no tenants; without tenants omit --tenants (and keep the node private)")
        _check_unique(tenants, source)
        return cls(tenants, shared, shared_quota, source)


def _tenant(entry: Any, index: int, shared: Grants, source: str) -> Tenant:
    where = f"{source}: tenant {index}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with name, token and namespaces")
    unknown = set(entry) - _TENANT_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(_TENANT_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: needs a non-empty 'name'")
    where = f"{source}: tenant {name!r}"
    cert_names = entry.get("cert_names", [])
    if not isinstance(cert_names, list) or not all(isinstance(n, str) and n for n in cert_names):
        raise ValueError(f"{where}: 'cert_names' must be a list of non-empty strings (certificate CN or SAN values)")
    if "token" in entry and "token_sha256" in entry:
        raise ValueError(f"{where}: give at most one of 'token' and 'token_sha256'")
    if "token" not in entry and "token_sha256" not in entry:
        if not cert_names:
            raise ValueError(f"{where}: give 'token', 'token_sha256' or 'cert_names'")
        digest = b""  # certificate only: no token matches (compare_digest of unequal lengths is False)
    elif "token" in entry:
        token = entry["token"]
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}: token must be a string of at least {MIN_TOKEN_CHARS} characters")
        digest = token_digest(token)
    else:
        try:
            digest = bytes.fromhex(str(entry["token_sha256"]))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: token_sha256 must be 64 hex digits (SHA-256 of the token)")
    namespaces = entry.get("namespaces", [])
    if not isinstance(namespaces, list):
        raise ValueError(f"{where}: 'namespaces' must be a list")
    max_streams = entry.get("max_streams")
    if max_streams is not None and (not isinstance(max_streams, int) or max_streams < 0):
        raise ValueError(f"{where}: max_streams must be a non-negative integer")
    return Tenant(
        name=name,
        digest=digest,
        grants=Grants.parse(namespaces, where),
        admin=bool(entry.get("admin")),
        quota_bytes=_size(entry.get("quota"), f"{where}: quota"),
        max_streams=max_streams,
        shared=shared,
        cert_names=frozenset(cert_names),
    )


def _size(value: Any, where: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _check_unique(tenants: tuple[Tenant, ...], source: str) -> None:
    names: set[str] = set()
    digests: set[bytes] = set()
    certs: dict[str, str] = {}
    holders: dict[str, list[str]] = {}
    for tenant in tenants:
        if tenant.name in names:
            raise ValueError(f"{source}: tenant name {tenant.name!r} appears twice")
        if tenant.digest and tenant.digest in digests:
            raise ValueError(f"{source}: tenant {tenant.name!r} has the same token as another tenant")
        for cert in tenant.cert_names:
            if cert in certs:
                raise ValueError(
                    f"{source}: certificate name {cert!r} is listed by tenants {certs[cert]!r} and {tenant.name!r}"
                )
            certs[cert] = tenant.name
        names.add(tenant.name)
        digests.add(tenant.digest)
        for ns in tenant.grants.exact:
            holders.setdefault(ns, []).append(tenant.name)
    for ns, who in sorted(holders.items()):
        if len(who) > 1:
            log.warning("%s: namespace %r is shared by tenants %s (listed under each)", source, ns, ", ".join(who))
