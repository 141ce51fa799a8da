"""Lane selection: same host -> shm, else tcp, else gRPC; explicit choices; what the node reports."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import generate_latest

from kvstore.client import Client, KVStoreError
from kvstore.lanes.client import negotiate
from kvstore.lanes.shm_region import RegionError
from tests.test_lanes_support import keys


@pytest.fixture
def lane_server(make_server):
    return make_server(shm_lane_bytes=8 << 20)


def round_trip(kv: Client) -> None:
    assert kv.put("ns", keys(2), [b"a" * 1000, b"b" * 1000])[0].ok
    assert [bytes(b) for b in kv.get("ns", keys(2))] == [b"a" * 1000, b"b" * 1000]


def test_auto_picks_shm_on_the_same_host(lane_server):
    with Client(f"127.0.0.1:{lane_server.port}") as kv:
        assert kv.lane_kind == "grpc"  # nothing negotiated before the first put/get
        round_trip(kv)
        assert kv.lane_kind == "shm"
        counters = kv.stats()["counters"]
        assert counters["lane_shm_open"] == 1 and counters["lane_shm_put_bytes"] == 2000
    scrape = generate_latest(lane_server.metrics.registry).decode()
    assert "kvstore_lane_shm_put_bytes 2000.0" in scrape and "kvstore_lane_shm_get_bytes 2000.0" in scrape


def test_auto_picks_tcp_from_another_host(lane_server, monkeypatch):
    monkeypatch.setattr(negotiate, "host_id", lambda: "another-boot-id/another-host")
    with Client(f"127.0.0.1:{lane_server.port}") as kv:
        round_trip(kv)
        assert kv.lane_kind == "tcp"
        assert kv.stats()["counters"]["lane_tcp_put_bytes"] == 2000


def test_unmappable_region_falls_back_to_tcp(lane_server, monkeypatch):
    def refuse(*_args, **_kw):
        raise RegionError(1, "another /dev/shm")

    monkeypatch.setattr("kvstore.lanes.client.shm.attach", refuse)
    with Client(f"127.0.0.1:{lane_server.port}") as kv:
        round_trip(kv)
        assert kv.lane_kind == "tcp"
        assert len(lane_server.lanes.registry) == 1  # the shm lane it could not map was closed


def test_refused_tcp_hello_falls_back_to_grpc(lane_server, monkeypatch):
    """A tcp lane whose hello is refused (the connection reached another node) is dropped, not raised."""

    def refuse(*_args, **_kw):
        raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION, "lane 'x' is not open")

    monkeypatch.setattr(negotiate, "host_id", lambda: "another-boot-id/another-host")
    monkeypatch.setattr("kvstore.lanes.client.tcp.TcpClientLane.__init__", refuse)
    with Client(f"127.0.0.1:{lane_server.port}") as kv:
        round_trip(kv)
        assert kv.lane_kind == "grpc"
        assert len(lane_server.lanes.registry) == 0  # the lane it could not use was closed on the server


def test_grpc_lane_never_opens_a_lane(lane_server):
    with Client(f"127.0.0.1:{lane_server.port}", lane="grpc") as kv:
        round_trip(kv)
        assert kv.lane_kind == "grpc" and len(lane_server.lanes.registry) == 0


def test_node_without_lanes(make_server):
    server = make_server(lanes="")
    target = f"127.0.0.1:{server.port}"
    with Client(target) as kv:
        round_trip(kv)
        assert kv.lane_kind == "grpc"
    for lane in ("shm", "tcp"):
        with Client(target, lane=lane) as kv, pytest.raises(KVStoreError) as err:
            kv.put("ns", keys(1), [b"x"])
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and f"{lane} lane disabled" in err.value.message


def test_lane_limit_falls_back_to_grpc(make_server):
    server = make_server(lane_max=1, shm_lane_bytes=8 << 20)
    target = f"127.0.0.1:{server.port}"
    with Client(target) as first, Client(target) as second:
        round_trip(first)
        round_trip(second)
        assert first.lane_kind == "shm" and second.lane_kind == "grpc"


def test_unknown_lane_name_is_refused(lane_server):
    with pytest.raises(ValueError, match="lane must be one of"):
        Client(f"127.0.0.1:{lane_server.port}", lane="carrier-pigeon")


def test_tls_node_offers_no_plaintext_tcp_lane(make_server, tmp_path):
    from tests.certs import make_tls_files

    pki = make_tls_files(tmp_path / "pki")
    server = make_server(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    assert server.lanes.tcp is None
    with Client(f"127.0.0.1:{server.port}", tls_ca=str(pki.ca), lane="auto") as kv:
        round_trip(kv)
        assert kv.lane_kind == "shm"
    with (
        Client(f"127.0.0.1:{server.port}", tls_ca=str(pki.ca), lane="tcp") as kv,
        pytest.raises(KVStoreError, match="tcp lane disabled"),
    ):
        kv.get("ns", keys(1))
