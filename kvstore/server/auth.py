"""Who is calling, and may they: the interceptor in front of every RPC, and the checks handlers call.

``Gatekeeper.from_config(cfg, store, metrics)`` builds the node's policy and
``interceptors()`` the ``grpc.ServerInterceptor`` that every RPC passes
(except ``grpc.health.v1``, which probes call without credentials):

1. **Authentication** (with ``--tenants``): the ``authorization: Bearer
   <token>`` metadata must name a tenant (``TenantRegistry.authenticate``,
   constant time), else UNAUTHENTICATED before the request is even parsed.
   Under mutual TLS a call without a token may instead be named by its
   verified client certificate (a tenant's ``cert_names`` holds its CN or a
   SAN); that is decided inside the call, where the TLS peer is visible.
   Without ``--tenants`` every caller is the ``OPEN`` principal (all
   namespaces, whole-node Stats). Tokens are never logged or echoed.
2. **Malformed requests**: bytes that do not parse as the method's request
   message end the call with INVALID_ARGUMENT (gRPC's default is INTERNAL).
3. **Streams per tenant**: a tenant's concurrent request- or response-
   streaming RPCs beyond its ``max_streams`` get RESOURCE_EXHAUSTED.
4. **Deadline**: no RPC outlives ``--max-rpc-seconds`` (DEADLINE_EXCEEDED).

The authenticated ``Principal`` is then ``current_principal()`` inside the
handler (a context variable set for the call). Handlers of every service
(KVStore, and any lane or cluster service on the same server) call
``gate.authorize(context, namespace)`` with the request's namespace before
touching the store: PERMISSION_DENIED for a namespace not granted, with the
same message and the same (store-free) path whether or not that namespace
exists, so a tenant can neither read another's blocks nor learn or time
their existence. ``gate.authorize_node(context)`` guards whole-node views
(Stats without a namespace): admin tenants only.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc

from kvstore.config import ServeConfig
from kvstore.server.quotas import ByteQuotas, DeadlineWatchdog, StreamSlots
from kvstore.server.tenants import Tenant, TenantRegistry
from kvstore.store import BlockStore

if TYPE_CHECKING:  # grpc-stubs make these generic; at run time they are plain classes
    _Interceptor = grpc.ServerInterceptor[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor
_R = TypeVar("_R", bound="TenantRegistry | None")

log = logging.getLogger(__name__)

UNGUARDED = ("/grpc.health.v1.Health/",)
_KINDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


@dataclass(frozen=True)
class Principal:
    """The caller of one RPC: a tenant, or OPEN when the node has no tenants file."""

    name: str
    tenant: Tenant | None = None

    @property
    def admin(self) -> bool:
        return self.tenant is None or self.tenant.admin

    def allows(self, namespace: str) -> bool:
        return self.tenant is None or self.tenant.allows(namespace)


OPEN = Principal("(open)")
# The interceptor's answer for a call with no token where tenants may be named by client certificate: not a
# principal (it grants nothing); the call itself looks at its TLS peer and aborts unless a tenant matches.
BY_CERTIFICATE: Any = object()
_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvstore_principal", default=None)


def current_principal() -> Principal | None:
    """The principal of the RPC being handled (None outside the interceptor)."""
    return _PRINCIPAL.get()


@dataclass(frozen=True)
class Malformed:
    """Stands in for a request message that failed to parse."""

    error: str


def bearer_token(metadata: Any) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry; "" for another scheme, None if absent."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return None


@dataclass
class Gatekeeper:
    """The node's access policy: who may call (tenants), what they may touch, and how much."""

    registry: TenantRegistry | None = None
    tenants_path: str | None = None
    default_quota: int = 0
    default_streams: int = 0
    quotas: ByteQuotas | None = None
    slots: StreamSlots = field(default_factory=StreamSlots)
    watchdog: DeadlineWatchdog | None = None
    long_lived: set[str] = field(default_factory=set)  # methods exempt from the deadline (e.g. lane sessions)
    count: Callable[[str], None] = lambda name: None  # e.g. Metrics.add
    client_certificates: bool = False  # mTLS: every caller shows a certificate the CA signed

    @classmethod
    def from_config(cls, cfg: ServeConfig, store: BlockStore | None = None, metrics: Any = None) -> Gatekeeper:
        gate = cls(
            registry=TenantRegistry.load(cfg.tenants) if cfg.tenants else None,
            tenants_path=cfg.tenants,
            default_quota=cfg.tenant_quota,
            default_streams=cfg.tenant_streams,
            client_certificates=bool(cfg.tls_client_ca),
        )
        gate._check_certificates(gate.registry)
        if metrics is not None:
            gate.count = metrics.add
        if cfg.max_rpc_seconds > 0:
            gate.watchdog = DeadlineWatchdog(
                cfg.max_rpc_seconds, on_expire=lambda _method: gate.count("rpc_deadline_expired")
            )
        if gate.registry is not None and store is not None:
            gate.quotas = ByteQuotas(store, gate._bucket_of, gate._quota_of)
            log.info("tenants: %s", ", ".join(t.name + (" (admin)" if t.admin else "") for t in gate.registry.tenants))
        return gate

    def _bucket_of(self, namespace: str) -> str:
        assert self.registry is not None
        return self.registry.bucket_of(namespace)

    def _quota_of(self, bucket: str) -> int | None:
        assert self.registry is not None
        return self.registry.quota_of(bucket, self.default_quota or None)

    # -- lifecycle -------------------------------------------------------------------
    def interceptors(self) -> list[_Interceptor]:
        return [GuardInterceptor(self)]

    def start(self) -> None:
        if self.watchdog is not None:
            self.watchdog.start()

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def reload_tenants(self) -> bool:
        """Re-read the tenants file (SIGHUP); on any error keep the current tenants and say why."""
        if not self.tenants_path:
            return False
        try:
            self.registry = registry = self._check_certificates(TenantRegistry.load(self.tenants_path))
        except (OSError, ValueError) as err:
            log.error("tenants file not reloaded, keeping the previous tenants: %s", err)
            return False
        log.info("tenants reloaded: %d tenants", len(registry.tenants))
        return True

    def _check_certificates(self, registry: _R) -> _R:
        if registry is not None and registry.by_certificate and not self.client_certificates:
            raise ValueError(
                f"{registry.source}: tenants named by client certificate (cert_names) need mutual TLS "
                f"(--tls-client-ca); without it no caller shows a certificate"
            )
        return registry

    # -- authentication (interceptor) --------------------------------------------------
    def authenticate(self, metadata: Any) -> tuple[Principal | None, str]:
        """The caller by its bearer token; ``BY_CERTIFICATE`` when it sent none and tenants may be named by
        their client certificate (the interceptor cannot see the TLS peer: ``authenticate_peer`` decides
        inside the call)."""
        registry = self.registry
        if registry is None:
            return OPEN, ""
        token = bearer_token(metadata)
        if token is None and registry.by_certificate and self.client_certificates:
            return BY_CERTIFICATE, ""
        if token is None:
            return None, "this node needs a tenant token: send metadata 'authorization: Bearer <token>'"
        tenant = registry.authenticate(token)
        if tenant is None:
            return None, "the bearer token is not valid for this node"
        return Principal(tenant.name, tenant), ""

    def authenticate_peer(self, context: grpc.ServicerContext) -> Principal | None:
        """The tenant named by the verified client certificate of this call (its CN or a SAN), if exactly one."""
        registry = self.registry
        if registry is None:
            return None
        # grpc-stubs type each property as bytes; grpc gives an iterable of bytes values, as its docs say
        auth = cast("Mapping[str, Iterable[bytes]]", context.auth_context()) or {}
        names = [
            v.decode(errors="replace")
            for key in ("x509_common_name", "x509_subject_alternative_name")
            for v in auth.get(key, [])
        ]
        tenant = registry.authenticate_certificate(names)
        return Principal(tenant.name, tenant) if tenant is not None else None

    def enter(self, principal: Principal, method: str, streaming: bool, context: grpc.ServicerContext) -> None:
        """Take a stream slot and start the deadline clock; both are given back when the call ends."""
        cleanups: list[Callable[[], None]] = []
        tenant = principal.tenant
        if streaming and tenant is not None:
            limit = tenant.max_streams if tenant.max_streams is not None else self.default_streams
            if not self.slots.acquire(tenant.name, limit):
                self.count("tenant_streams_refused")
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"tenant {tenant.name!r} already has {limit} open streams (Put/Get); "
                    f"wait for one to finish or ask for a higher max_streams",
                )
            cleanups.append(lambda: self.slots.release(tenant.name))
        watchdog = self.watchdog
        if watchdog is not None and method not in self.long_lived:
            token = watchdog.watch(context, method)
            cleanups.append(lambda: watchdog.unwatch(token))
        if cleanups:

            def done() -> None:
                for fn in cleanups:
                    fn()

            if not context.add_callback(done):
                done()

    # -- authorization (handlers) -------------------------------------------------------
    def authorize(self, context: grpc.ServicerContext, namespace: str) -> Principal:
        """The caller, if it may use `namespace`; else the call ends with PERMISSION_DENIED."""
        principal = _PRINCIPAL.get()
        if principal is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the request did not pass authentication")
        if not principal.allows(namespace):
            self.count("permission_denied")
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"tenant {principal.name!r} may not use namespace {namespace!r}"
            )
        return principal

    def authorize_node(self, context: grpc.ServicerContext) -> Principal:
        """The caller, if it may see whole-node state (admin or no tenants file)."""
        principal = _PRINCIPAL.get()
        if principal is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "the request did not pass authentication")
        if not principal.admin:
            self.count("permission_denied")
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {principal.name!r} is not an admin: whole-node Stats are for admin tenants; "
                f"ask for one of your namespaces (StatsRequest.namespace)",
            )
        return principal

    def admit_block(self, namespace: str, nbytes: int, key: bytes | None = None) -> str | None:
        """None if a block of `nbytes` may be put: it fits its namespace's quota, or (when `key` is
        given) it is already stored, so the Put reports it present at no cost; else why it may not."""
        if self.quotas is None:
            return None
        reason = self.quotas.admit(namespace, nbytes)
        if reason is not None and key is not None and self.quotas.store.lookup(namespace, [key])[0] == 1:
            return None
        if reason is not None:
            self.count("quota_rejected")
        return reason

    def charge(self, namespace: str, nbytes: int) -> None:
        if self.quotas is not None:
            self.quotas.charge(namespace, nbytes)

    def quota_counters(self, namespace: str) -> dict[str, float]:
        """For Stats of `namespace`: bytes charged to its quota bucket and the quota (0: none)."""
        if self.quotas is None or self.registry is None:
            return {}
        self.quotas.rescan()
        bucket = self._bucket_of(namespace)
        return {"quota_used_bytes": float(self.quotas.usage(bucket)), "quota_bytes": float(self._quota_of(bucket) or 0)}


class GuardInterceptor(_Interceptor):
    """Wraps each method handler with authentication, request parsing, stream slots and deadline."""

    def __init__(self, gate: Gatekeeper):
        self.gate = gate

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(UNGUARDED):
            return handler
        principal, error = self.gate.authenticate(details.invocation_metadata)
        if principal is None:
            self.gate.count("unauthenticated")
            return _refusing(handler, error)
        return _guarded(handler, details.method, principal, self.gate)  # BY_CERTIFICATE: resolved in the call


def _refusing(handler: Handler, message: str) -> Handler:
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # grpc's method handlers are namedtuples; grpc-stubs leave _replace out
    refusing: Handler = handler._replace(request_deserializer=None, **{kind: refuse})  # type: ignore[attr-defined]
    return refusing  # unauthenticated bytes are never parsed


def _guarded(handler: Handler, method: str, principal: Principal, gate: Gatekeeper) -> Handler:
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, kind)
    parse = handler.request_deserializer
    streaming = handler.request_streaming or handler.response_streaming
    message_name = method.rsplit("/", 1)[-1]

    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for i, request in enumerate(requests):
            if isinstance(request, Malformed):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{message_name} message {i} is not a valid request message: {request.error}",
                )
            yield request

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        caller: Principal | None
        caller = principal
        if caller is BY_CERTIFICATE:
            caller = gate.authenticate_peer(context)
            if caller is None:
                gate.count("unauthenticated")
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no bearer token, and this client certificate names no tenant of this node",
                )
        _PRINCIPAL.set(caller)
        gate.enter(caller, method, streaming, context)
        if handler.request_streaming:
            request = checked(request, context)
        elif isinstance(request, Malformed):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{message_name}: the request is not a valid request message: {request.error}",
            )
        return behavior(request, context)

    guarded: Handler = handler._replace(  # type: ignore[attr-defined]  # a namedtuple, as above
        request_deserializer=_lenient(parse) if parse is not None else None, **{kind: run}
    )
    return guarded


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, answering a Malformed marker instead of raising for bytes that are not a request message."""

    def lenient(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as err:  # noqa: BLE001 - any parse failure is the caller's malformed input
            return Malformed(f"{type(err).__name__}: {err}"[:200])

    return lenient
