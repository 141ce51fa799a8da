"""The error every client end raises, and the conversions into it.

Imported by the node client, the lanes' client ends, the codec transfer and the cluster client, so it
imports nothing of theirs (a leaf of the client side).

- ``KVStoreError(code, message)``: a gRPC status code and a message a person can act on.
- ``status_code(value) -> grpc.StatusCode``: the enum member for a status code's wire integer.
- ``from_rpc(err) -> KVStoreError``: a failed gRPC call as a KVStoreError.
- ``corrupt_block(index, block_hash) -> KVStoreError``: DATA_LOSS for a block whose CRC32C does not match.
- ``short_buffer(index, size, needed) -> KVStoreError``: INVALID_ARGUMENT for an ``out`` buffer too small.
"""

from __future__ import annotations

import grpc

_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class KVStoreError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


def status_code(value: int) -> grpc.StatusCode:
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def from_rpc(err: grpc.RpcError) -> KVStoreError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    # str(): grpc types details() as str | None; a None keeps reading "None", as it always has
    return KVStoreError(code, str(err.details()) if hasattr(err, "details") else str(err))


def corrupt_block(index: int, block_hash: bytes) -> KVStoreError:
    return KVStoreError(grpc.StatusCode.DATA_LOSS, f"block {index} ({block_hash.hex()}) failed its CRC32C check")


def short_buffer(index: int, size: int, needed: int) -> KVStoreError:
    return KVStoreError(
        grpc.StatusCode.INVALID_ARGUMENT, f"output buffer {index} holds {size} bytes; block is {needed}"
    )
