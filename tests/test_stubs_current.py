"""The committed gRPC stubs must match proto/: regenerate with `python -m kvstore.genproto`.

The stubs carry the versions of their generator, which they check at import (grpcio >= GRPC_GENERATED_VERSION,
protobuf's runtime >= its gencode version): the package's declared floors must cover them, or an install that
pip accepts fails on its first import.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstore.genproto import generate

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "kvstore" / "v1"
GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", re.M)
PROTOBUF_STAMP = re.compile(r"^# Protobuf Python Version: ([\d.]+)$", re.M)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_stubs_match_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = COMMITTED / path.name
        assert committed.exists(), f"{committed} missing: run python -m kvstore.genproto"
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} differs from what this grpcio-tools makes: run python -m kvstore.genproto with the "
            "test extra's grpcio-tools (a different version stamps its own floors into the stubs)"
        )


def test_declared_floors_cover_what_the_stubs_check():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {m[1]: _version(m[2]) for d in deps if (m := re.match(r"([\w-]+)>=([\d.]+)", d))}
    for path in sorted(COMMITTED.glob("*_pb2_grpc.py")):
        stamp = GRPC_STAMP.search(path.read_text())
        assert stamp is not None, path
        assert floors["grpcio"] >= _version(stamp[1]), f"{path.name} needs grpcio>={stamp[1]} at import"
    for path in sorted(COMMITTED.glob("*_pb2.py")):
        stamp = PROTOBUF_STAMP.search(path.read_text())
        assert stamp is not None, path
        assert floors["protobuf"] >= _version(stamp[1]), f"{path.name} needs protobuf>={stamp[1]} at import"
