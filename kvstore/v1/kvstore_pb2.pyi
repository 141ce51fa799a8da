from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_NONE: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]
    CODEC_BYTEPLANE: _ClassVar[Codec]
    CODEC_FP8: _ClassVar[Codec]
    CODEC_FP8_ZSTD: _ClassVar[Codec]
    CODEC_LZ4: _ClassVar[Codec]

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    PUT_STORED: _ClassVar[PutStatus]
    PUT_ALREADY_PRESENT: _ClassVar[PutStatus]
    PUT_REJECTED: _ClassVar[PutStatus]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
CODEC_NONE: Codec
CODEC_ZSTD: Codec
CODEC_BYTEPLANE: Codec
CODEC_FP8: Codec
CODEC_FP8_ZSTD: Codec
CODEC_LZ4: Codec
PUT_STATUS_UNSPECIFIED: PutStatus
PUT_STORED: PutStatus
PUT_ALREADY_PRESENT: PutStatus
PUT_REJECTED: PutStatus

class BlockHeader(_message.Message):
    __slots__ = ("hash", "parent", "codec", "raw_length", "stored_length", "crc32c", "dtype", "missing")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STORED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    parent: bytes
    codec: Codec
    raw_length: int
    stored_length: int
    crc32c: int
    dtype: str
    missing: bool
    def __init__(self, hash: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_length: _Optional[int] = ..., stored_length: _Optional[int] = ..., crc32c: _Optional[int] = ..., dtype: _Optional[str] = ..., missing: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "tiers")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_length: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "header", "data", "blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    header: BlockHeader
    data: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    def __init__(self, namespace: _Optional[str] = ..., header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ...) -> None: ...

class BlockResult(_message.Message):
    __slots__ = ("hash", "status", "code", "reason", "tier")
    HASH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    status: PutStatus
    code: int
    reason: str
    tier: Tier
    def __init__(self, hash: _Optional[bytes] = ..., status: _Optional[_Union[PutStatus, str]] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class CodecTiming(_message.Message):
    __slots__ = ("codec", "dtype", "raw_bytes", "blocks", "seconds")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    dtype: str
    raw_bytes: int
    blocks: int
    seconds: float
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., dtype: _Optional[str] = ..., raw_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results", "decode_timings", "packed_bytes")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BlockResult]
    decode_timings: _containers.RepeatedCompositeFieldContainer[CodecTiming]
    packed_bytes: int
    def __init__(self, results: _Optional[_Iterable[_Union[BlockResult, _Mapping]]] = ..., decode_timings: _Optional[_Iterable[_Union[CodecTiming, _Mapping]]] = ..., packed_bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "accepted_codecs", "allow_missing", "decode_report", "packed")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_CODECS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_MISSING_FIELD_NUMBER: _ClassVar[int]
    DECODE_REPORT_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    accepted_codecs: _containers.RepeatedScalarFieldContainer[Codec]
    allow_missing: bool
    decode_report: _containers.RepeatedCompositeFieldContainer[CodecTiming]
    packed: bool
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., accepted_codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., allow_missing: _Optional[bool] = ..., decode_report: _Optional[_Iterable[_Union[CodecTiming, _Mapping]]] = ..., packed: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "data", "blocks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "hits", "evictions", "backend", "degraded", "fault")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    evictions: int
    backend: str
    degraded: bool
    fault: str
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., backend: _Optional[str] = ..., degraded: _Optional[bool] = ..., fault: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "blocks", "lookups", "lookup_hits", "lookup_misses", "bytes_in", "bytes_out", "counters", "node_id", "lookup_hashes")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HASHES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    blocks: int
    lookups: int
    lookup_hits: int
    lookup_misses: int
    bytes_in: int
    bytes_out: int
    counters: _containers.ScalarMap[str, float]
    node_id: str
    lookup_hashes: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., blocks: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., lookup_misses: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ..., node_id: _Optional[str] = ..., lookup_hashes: _Optional[int] = ...) -> None: ...
