"""HOST:PORT options and client targets: a port gRPC would wrap round (PORT % 65536) is refused, not reached."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.addresses import check_target, parse_address
from kvstore.client import Client


@given(st.sampled_from(["127.0.0.1", "0.0.0.0", "[::1]", "node-a.kv", ""]), st.integers(0, 65535))
def test_every_port_in_range_is_taken_as_given(host, port):
    assert parse_address(f"{host}:{port}") == f"{host}:{port}"
    check_target(f"{host}:{port}")


@given(st.integers(65536, 10**12))
def test_a_port_past_65535_is_refused(port):
    with pytest.raises(ValueError, match="port 0-65535"):
        parse_address(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="port must be 0-65535"):
        check_target(f"127.0.0.1:{port}")


@pytest.mark.parametrize("text", ["bogus", "127.0.0.1:", "127.0.0.1:-1", "127.0.0.1:80x", ":"])
def test_what_is_not_host_port_is_refused(text):
    with pytest.raises(ValueError, match="not HOST:PORT"):
        parse_address(text)


@pytest.mark.parametrize("target", ["dns:///127.0.0.1:7070", "unix:/run/kv.sock", "ipv4:127.0.0.1:7070", "localhost"])
def test_other_grpc_target_forms_pass(target):
    check_target(target)


def test_a_client_refuses_a_wrapping_port_before_it_connects():
    with pytest.raises(ValueError, match="'127.0.0.1:99999': the port must be 0-65535"):
        Client("127.0.0.1:99999")
