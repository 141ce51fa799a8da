"""The committed gRPC stubs must match proto/: regenerate with `python -m kvstore.genproto`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.genproto import generate

COMMITTED = Path(__file__).resolve().parent.parent / "kvstore" / "v1"


def test_stubs_match_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = COMMITTED / path.name
        assert committed.exists(), f"{committed} missing: run python -m kvstore.genproto"
        assert committed.read_text() == path.read_text(), f"{committed.name} is stale: run python -m kvstore.genproto"
