"""Tenants through a real server: tokens, namespace isolation, no existence oracle, Stats scope, health."""

from __future__ import annotations

import hmac
import logging
from types import SimpleNamespace

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client, KVStoreError
from kvstore.hashing import block_hashes
from kvstore.server import tenants
from kvstore.server.tenants import SHARED, TenantRegistry, token_digest
from kvstore.v1 import kvstore_pb2 as pb

TOKEN_A = "token-of-tenant-a-0123456789"
TOKEN_B = "token-of-tenant-b-9876543210"
TOKEN_OPS = "token-of-the-operator-000000"
TENANTS = {
    "shared_namespaces": ["public"],
    "tenants": [
        {"name": "a", "token": TOKEN_A, "namespaces": ["ns-a", "a/*", "both"]},
        {"name": "b", "token": TOKEN_B, "namespaces": ["ns-b", "both"]},
        {"name": "ops", "token_sha256": token_digest(TOKEN_OPS).hex(), "namespaces": [], "admin": True},
    ],
}


@pytest.fixture
def tenant_server(make_server, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    return make_server(tenants=str(path))


def target(server) -> str:
    return f"127.0.0.1:{server.port}"


@pytest.fixture(params=["grpc", "auto"])
def lane(request) -> str:
    """Every check holds on the gRPC stream and on the data lanes a client negotiates (shm here)."""
    return request.param


def keys(ns: str, n: int = 4) -> list[bytes]:
    return block_hashes(list(range(16 * n)), 16, ns, "model")


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KVStoreError) as err:
        fn()
    return err.value.code, err.value.message


# -- authentication ----------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "not-a-valid-token-at-all", TOKEN_A[:-1], ""])
def test_missing_or_invalid_token_is_unauthenticated(tenant_server, token):
    with Client(target(tenant_server), token=token, retries=0) as kv:
        for call in (
            lambda: kv.lookup("ns-a", keys("ns-a")),
            lambda: kv.get("ns-a", keys("ns-a")),
            lambda: kv.put("ns-a", keys("ns-a", 1), [b"x" * 64]),
            lambda: kv.delete("ns-a", keys("ns-a")),
            lambda: kv.stats("ns-a"),
        ):
            code, message = code_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "token" in message and (not token or token not in message)
    assert tenant_server.store.stats()["blocks"] == 0


def test_health_needs_no_token(tenant_server):
    with grpc.insecure_channel(target(tenant_server)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tokens_never_logged(make_server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(TENANTS))
    server = make_server(tenants=str(path), log_level="debug")
    with Client(target(server), token="wrong-token-that-must-not-be-logged", retries=0) as kv:
        code_of(lambda: kv.lookup("ns-a", keys("ns-a")))
    with Client(target(server), token=TOKEN_A) as kv:
        kv.put("ns-a", keys("ns-a", 1), [b"x" * 64])
        code_of(lambda: kv.lookup("ns-b", keys("ns-b")))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "tenants: a, b, ops (admin)" in text
    for secret in (TOKEN_A, TOKEN_B, TOKEN_OPS, "wrong-token-that-must-not-be-logged"):
        assert secret not in text
    assert TOKEN_A not in repr(server.gate.registry)


def test_authentication_compares_every_digest(monkeypatch):
    """Constant time: the number of comparisons does not depend on which tenant (if any) matches."""
    registry = TenantRegistry.parse(TENANTS)
    calls: list[int] = []
    real = hmac.compare_digest
    monkeypatch.setattr(tenants, "hmac", SimpleNamespace(compare_digest=lambda x, y: calls.append(1) or real(x, y)))
    for token in (TOKEN_A, TOKEN_B, TOKEN_OPS, "no-such-token-0000000000"):
        calls.clear()
        found = registry.authenticate(token)
        assert len(calls) == len(registry.tenants)
        assert (found.name if found else None) == {TOKEN_A: "a", TOKEN_B: "b", TOKEN_OPS: "ops"}.get(token)


# -- namespaces -------------------------------------------------------------------------------
def test_each_tenant_reaches_only_its_namespaces(tenant_server, lane):
    kb = keys("ns-b")
    with Client(target(tenant_server), token=TOKEN_B, lane=lane) as b:
        assert all(r.status == "stored" for r in b.put("ns-b", kb, [k * 64 for k in kb]))
    with Client(target(tenant_server), token=TOKEN_A, lane=lane, retries=0) as a:
        lookups_before = tenant_server.store.stats()["lookups"]
        for call in (
            lambda: a.lookup("ns-b", kb),
            lambda: a.get("ns-b", kb),
            lambda: a.delete("ns-b", kb),
            lambda: a.put("ns-b", kb[:1], [b"evil" * 16]),
            lambda: a.stats("ns-b"),
        ):
            code, message = code_of(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "'ns-b'" in message
        assert tenant_server.store.stats()["lookups"] == lookups_before  # denied before the store was touched
        # prefix grant, shared namespaces (declared, and listed under both tenants)
        for ns in ("a/sub/x", "public", "both"):
            k = keys(ns, 1)
            assert a.put(ns, k, [b"y" * 32])[0].status == "stored"
    with Client(target(tenant_server), token=TOKEN_B, lane=lane) as b:
        assert b.get("ns-b", kb) == [k * 64 for k in kb]  # untouched by a's attempts
        assert b.lookup("public", keys("public", 1)) == 1 and b.lookup("both", keys("both", 1)) == 1
        assert code_of(lambda: b.lookup("a/sub/x", keys("a/sub/x", 1)))[0] == grpc.StatusCode.PERMISSION_DENIED


def test_no_existence_oracle(tenant_server, lane):
    """Denial for b's namespace reads the same whether it holds blocks, is empty or never existed."""
    with Client(target(tenant_server), token=TOKEN_B, lane=lane) as b:
        b.put("ns-b", keys("ns-b"), [b"z" * 64] * 4)
    with Client(target(tenant_server), token=TOKEN_A, lane=lane, retries=0) as a:
        seen = {
            ns: code_of(lambda ns=ns: a.lookup(ns, keys("ns-b")))[1].replace(repr(ns), "NS")
            for ns in ("ns-b", "never-created", "ns-b-typo")
        }
        assert len(set(seen.values())) == 1, seen
        code_of(lambda: a.put("never-created", keys("x", 1), [b"q" * 16]))
    assert tenant_server.store.table.namespace_id("never-created") is None  # a denied Put creates nothing


def test_anothers_hashes_in_my_namespace_are_plain_misses(tenant_server, lane):
    """Hashes include the namespace, and a lookup in a's namespace never sees b's blocks: same path as a miss."""
    kb = keys("ns-b")
    with Client(target(tenant_server), token=TOKEN_B, lane=lane) as b:
        b.put("ns-b", kb, [b"s" * 64] * 4)
    with Client(target(tenant_server), token=TOKEN_A, lane=lane, retries=0) as a:
        assert a.lookup("ns-a", kb) == 0
        code, message = code_of(lambda: a.get("ns-a", kb))
        _, never = code_of(lambda: a.get("ns-a", [b"\x01" * 16]))
        assert code == grpc.StatusCode.NOT_FOUND
        assert message.replace(kb[0].hex(), "H") == never.replace((b"\x01" * 16).hex(), "H")
        assert a.get("ns-a", kb, allow_missing=True) == [None] * 4
        assert a.delete("ns-a", kb) == 0
    with Client(target(tenant_server), token=TOKEN_B, lane=lane) as b:
        assert b.lookup("ns-b", kb) == 4


# -- Stats --------------------------------------------------------------------------------------
def test_stats_scope(tenant_server, lane):
    with Client(target(tenant_server), token=TOKEN_B, lane=lane) as b:
        b.put("ns-b", keys("ns-b"), [b"w" * 1000] * 4)
    with Client(target(tenant_server), token=TOKEN_A, lane=lane, retries=0) as a:
        a.put("ns-a", keys("ns-a", 2), [b"v" * 500] * 2)
        code, message = code_of(lambda: a.stats())
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in message
        mine = a.stats("ns-a")
        assert mine["blocks"] == 2 and mine["counters"]["namespace_bytes"] == 1000
        assert mine["lookups"] == 0 and mine["bytes_in"] == 0  # no node-wide traffic figures
        dram = next(t for t in mine["tiers"] if t["name"] == "dram")
        assert dram["used_bytes"] == 1000 and dram["blocks"] == 2
    with Client(target(tenant_server), token=TOKEN_OPS, lane=lane) as ops:
        whole = ops.stats()
        assert whole["blocks"] == 6
        assert code_of(lambda: ops.stats("ns-a"))[0] == grpc.StatusCode.PERMISSION_DENIED  # admin != every namespace


def test_open_node_without_tenants_file(server):
    with Client(target(server)) as kv:
        kv.put("any", keys("any", 1), [b"o" * 10])
        assert kv.stats()["blocks"] == 1
        assert kv.stats("any")["counters"]["namespace_bytes"] == 10


def test_garbage_request_bytes_are_invalid_argument(tenant_server):
    channel = grpc.insecure_channel(target(tenant_server))
    lookup = channel.unary_unary("/kvstore.v1.KVStore/Lookup")
    meta = (("authorization", f"Bearer {TOKEN_A}"),)
    with pytest.raises(grpc.RpcError) as err:
        lookup(b"\x0a\xff\xff\xff\xff\x0f", timeout=5, metadata=meta)  # a string field longer than the message
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid request" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        lookup(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)  # unauthenticated bytes are not even parsed
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    put = channel.stream_unary("/kvstore.v1.KVStore/Put")
    with pytest.raises(grpc.RpcError) as err:
        put(iter([pb.PutRequest(namespace="ns-a").SerializeToString(), b"\x12\x05\x0a"]), timeout=5, metadata=meta)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "message 1" in err.value.details()
    channel.close()


# -- the tenants file ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "doc, needle",
    [
        ([{"name": "a", "token": "short", "namespaces": []}], "at least 16"),
        ([{"name": "a", "token": TOKEN_A, "namespace": ["x"]}], "unknown keys"),
        ([{"name": "a", "token": TOKEN_A}, {"name": "a", "token": TOKEN_B}], "appears twice"),
        ([{"name": "a", "token": TOKEN_A}, {"name": "b", "token": TOKEN_A}], "same token"),
        ([{"name": "a", "token": TOKEN_A, "token_sha256": "00"}], "at most one"),
        ([{"name": "a", "namespaces": ["x"]}], "'token', 'token_sha256' or 'cert_names'"),
        ([{"name": "a", "cert_names": ["w"]}, {"name": "b", "cert_names": ["w"]}], "listed by tenants"),
        ([{"name": "a", "cert_names": "w"}], "list of non-empty strings"),
        ([{"name": "a", "token_sha256": "abc"}], "64 hex"),
        ([{"name": "a", "token": TOKEN_A, "namespaces": ["bad\x00ns"]}], "NUL"),
        ([{"name": "a", "token": TOKEN_A, "quota": "lots"}], "not a size"),
        ([], "no tenants"),
        ({"tenants": [], "extra": 1}, "unknown keys"),
    ],
)
def test_tenants_file_errors_name_the_problem(doc, needle):
    with pytest.raises(ValueError) as err:
        TenantRegistry.parse(doc, source="t.yaml")
    assert needle in str(err.value) and TOKEN_A not in str(err.value)


def test_quota_buckets():
    registry = TenantRegistry.parse(TENANTS)
    assert registry.bucket_of("ns-a") == "a" and registry.bucket_of("a/deep") == "a"
    assert registry.bucket_of("both") == SHARED and registry.bucket_of("public") == SHARED
