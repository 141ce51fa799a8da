"""Names and conversions of the wire that every client end shares (the node client, the lanes, the cluster
client): the chunk size of a gRPC Put, the tier names of Lookup, and per-block Put results.

- ``CHUNK_BYTES``: the data bytes of one PutRequest message (DESIGN 2.3: at most 1 MiB).
- ``TIER_NAMES``: wire tier enum -> "hbm" | "dram" | "nvme".
- ``PutResult``: one block's outcome of a Put (stored, already present, or rejected with code and reason).
- ``put_result(r)`` / ``put_results(reply)``: PutResults from wire BlockResults.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from kvstore.errors import status_code
from kvstore.v1 import kvstore_pb2 as pb

CHUNK_BYTES = 1 << 20
TIER_NAMES: dict[int, str] = {pb.TIER_HBM: "hbm", pb.TIER_DRAM: "dram", pb.TIER_NVME: "nvme"}
PUT_STATUS = {pb.PUT_STORED: "stored", pb.PUT_ALREADY_PRESENT: "already_present", pb.PUT_REJECTED: "rejected"}


@dataclass(frozen=True, slots=True)
class PutResult:
    hash: bytes
    status: str  # "stored", "already_present" or "rejected"
    code: grpc.StatusCode = grpc.StatusCode.OK
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "rejected"


def put_result(r: pb.BlockResult) -> PutResult:
    code = grpc.StatusCode.OK if not r.code else status_code(r.code)
    return PutResult(r.hash, PUT_STATUS.get(r.status, "rejected"), code, r.reason)


def put_results(results: Iterable[pb.BlockResult]) -> list[PutResult]:
    return [put_result(r) for r in results]
