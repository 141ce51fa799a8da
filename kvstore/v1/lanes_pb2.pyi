from kvstore.v1 import kvstore_pb2 as _kvstore_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaneKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LANE_UNSPECIFIED: _ClassVar[LaneKind]
    LANE_SHM: _ClassVar[LaneKind]
    LANE_TCP: _ClassVar[LaneKind]
    LANE_CUDA_IPC: _ClassVar[LaneKind]
LANE_UNSPECIFIED: LaneKind
LANE_SHM: LaneKind
LANE_TCP: LaneKind
LANE_CUDA_IPC: LaneKind

class OpenLaneRequest(_message.Message):
    __slots__ = ("kinds", "host_id", "pid")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[LaneKind]
    host_id: str
    pid: int
    def __init__(self, kinds: _Optional[_Iterable[_Union[LaneKind, str]]] = ..., host_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class OpenLaneResponse(_message.Message):
    __slots__ = ("kind", "lane_id", "token", "host_id", "lease_seconds", "shm_path", "shm_bytes", "tcp_host", "tcp_port", "reason", "cuda_region", "direct_socket", "direct_segments", "dram_path", "dram_bytes", "nvme_dir", "dram_index_path", "dram_index_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TCP_HOST_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CUDA_REGION_FIELD_NUMBER: _ClassVar[int]
    DIRECT_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DIRECT_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DRAM_PATH_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_DIR_FIELD_NUMBER: _ClassVar[int]
    DRAM_INDEX_PATH_FIELD_NUMBER: _ClassVar[int]
    DRAM_INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: LaneKind
    lane_id: str
    token: bytes
    host_id: str
    lease_seconds: float
    shm_path: str
    shm_bytes: int
    tcp_host: str
    tcp_port: int
    reason: str
    cuda_region: CudaIpcRegion
    direct_socket: str
    direct_segments: bool
    dram_path: str
    dram_bytes: int
    nvme_dir: str
    dram_index_path: str
    dram_index_bytes: int
    def __init__(self, kind: _Optional[_Union[LaneKind, str]] = ..., lane_id: _Optional[str] = ..., token: _Optional[bytes] = ..., host_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., shm_path: _Optional[str] = ..., shm_bytes: _Optional[int] = ..., tcp_host: _Optional[str] = ..., tcp_port: _Optional[int] = ..., reason: _Optional[str] = ..., cuda_region: _Optional[_Union[CudaIpcRegion, _Mapping]] = ..., direct_socket: _Optional[str] = ..., direct_segments: _Optional[bool] = ..., dram_path: _Optional[str] = ..., dram_bytes: _Optional[int] = ..., nvme_dir: _Optional[str] = ..., dram_index_path: _Optional[str] = ..., dram_index_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcRegion(_message.Message):
    __slots__ = ("device_uuid", "device_index", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "host_path")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    device_index: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    host_path: str
    def __init__(self, device_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., host_path: _Optional[str] = ...) -> None: ...

class LaneRef(_message.Message):
    __slots__ = ("lane_id", "token")
    LANE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    lane_id: str
    token: bytes
    def __init__(self, lane_id: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class LanePutRequest(_message.Message):
    __slots__ = ("lane", "reserve", "commit")
    LANE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    lane: LaneRef
    reserve: LaneReserve
    commit: LaneCommit
    def __init__(self, lane: _Optional[_Union[LaneRef, _Mapping]] = ..., reserve: _Optional[_Union[LaneReserve, _Mapping]] = ..., commit: _Optional[_Union[LaneCommit, _Mapping]] = ...) -> None: ...

class LaneReserve(_message.Message):
    __slots__ = ("namespace", "headers", "release", "addresses", "segment_counts", "segment_addresses", "segment_lengths")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    headers: _containers.RepeatedCompositeFieldContainer[_kvstore_pb2.BlockHeader]
    release: _containers.RepeatedScalarFieldContainer[int]
    addresses: _containers.RepeatedScalarFieldContainer[int]
    segment_counts: _containers.RepeatedScalarFieldContainer[int]
    segment_addresses: _containers.RepeatedScalarFieldContainer[int]
    segment_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., headers: _Optional[_Iterable[_Union[_kvstore_pb2.BlockHeader, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ..., addresses: _Optional[_Iterable[int]] = ..., segment_counts: _Optional[_Iterable[int]] = ..., segment_addresses: _Optional[_Iterable[int]] = ..., segment_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class SlotGrant(_message.Message):
    __slots__ = ("offset", "length", "result")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    result: _kvstore_pb2.BlockResult
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., result: _Optional[_Union[_kvstore_pb2.BlockResult, _Mapping]] = ...) -> None: ...

class LaneGrant(_message.Message):
    __slots__ = ("grant_id", "slots", "expires_in")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotGrant]
    expires_in: float
    def __init__(self, grant_id: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotGrant, _Mapping]]] = ..., expires_in: _Optional[float] = ...) -> None: ...

class BlockDescriptor(_message.Message):
    __slots__ = ("index", "hash", "offset", "length", "crc32c", "header", "address", "segment_addresses", "segment_lengths", "in_dram", "disk_file", "disk_offset")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    IN_DRAM_FIELD_NUMBER: _ClassVar[int]
    DISK_FILE_FIELD_NUMBER: _ClassVar[int]
    DISK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    index: int
    hash: bytes
    offset: int
    length: int
    crc32c: int
    header: _kvstore_pb2.BlockHeader
    address: int
    segment_addresses: _containers.RepeatedScalarFieldContainer[int]
    segment_lengths: _containers.RepeatedScalarFieldContainer[int]
    in_dram: bool
    disk_file: str
    disk_offset: int
    def __init__(self, index: _Optional[int] = ..., hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., crc32c: _Optional[int] = ..., header: _Optional[_Union[_kvstore_pb2.BlockHeader, _Mapping]] = ..., address: _Optional[int] = ..., segment_addresses: _Optional[_Iterable[int]] = ..., segment_lengths: _Optional[_Iterable[int]] = ..., in_dram: _Optional[bool] = ..., disk_file: _Optional[str] = ..., disk_offset: _Optional[int] = ...) -> None: ...

class LaneCommit(_message.Message):
    __slots__ = ("grant_id", "blocks", "crc_from_server")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CRC_FROM_SERVER_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDescriptor]
    crc_from_server: bool
    def __init__(self, grant_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockDescriptor, _Mapping]]] = ..., crc_from_server: _Optional[bool] = ...) -> None: ...

class LaneCommitted(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_kvstore_pb2.BlockResult]
    def __init__(self, results: _Optional[_Iterable[_Union[_kvstore_pb2.BlockResult, _Mapping]]] = ...) -> None: ...

class LanePutResponse(_message.Message):
    __slots__ = ("grant", "committed")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    grant: LaneGrant
    committed: LaneCommitted
    def __init__(self, grant: _Optional[_Union[LaneGrant, _Mapping]] = ..., committed: _Optional[_Union[LaneCommitted, _Mapping]] = ...) -> None: ...

class LaneGetRequest(_message.Message):
    __slots__ = ("lane", "request", "release", "crc_at_copy", "out_addresses", "out_lengths", "out_segment_counts", "out_segment_addresses", "out_segment_lengths", "read_dram", "read_disk", "written_columns", "named_columns", "disk_columns")
    LANE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    CRC_AT_COPY_FIELD_NUMBER: _ClassVar[int]
    OUT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    OUT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    OUT_SEGMENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    OUT_SEGMENT_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    OUT_SEGMENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    READ_DRAM_FIELD_NUMBER: _ClassVar[int]
    READ_DISK_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    NAMED_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DISK_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    lane: LaneRef
    request: _kvstore_pb2.GetRequest
    release: _containers.RepeatedScalarFieldContainer[int]
    crc_at_copy: bool
    out_addresses: _containers.RepeatedScalarFieldContainer[int]
    out_lengths: _containers.RepeatedScalarFieldContainer[int]
    out_segment_counts: _containers.RepeatedScalarFieldContainer[int]
    out_segment_addresses: _containers.RepeatedScalarFieldContainer[int]
    out_segment_lengths: _containers.RepeatedScalarFieldContainer[int]
    read_dram: bool
    read_disk: bool
    written_columns: bool
    named_columns: bool
    disk_columns: bool
    def __init__(self, lane: _Optional[_Union[LaneRef, _Mapping]] = ..., request: _Optional[_Union[_kvstore_pb2.GetRequest, _Mapping]] = ..., release: _Optional[_Iterable[int]] = ..., crc_at_copy: _Optional[bool] = ..., out_addresses: _Optional[_Iterable[int]] = ..., out_lengths: _Optional[_Iterable[int]] = ..., out_segment_counts: _Optional[_Iterable[int]] = ..., out_segment_addresses: _Optional[_Iterable[int]] = ..., out_segment_lengths: _Optional[_Iterable[int]] = ..., read_dram: _Optional[bool] = ..., read_disk: _Optional[bool] = ..., written_columns: _Optional[bool] = ..., named_columns: _Optional[bool] = ..., disk_columns: _Optional[bool] = ...) -> None: ...

class WrittenBlocks(_message.Message):
    __slots__ = ("index", "length", "crc32c", "stored_crc32c")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    STORED_CRC32C_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    stored_crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., crc32c: _Optional[_Iterable[int]] = ..., stored_crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class NamedBlocks(_message.Message):
    __slots__ = ("index", "offset", "length", "crc32c")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class DiskBlocks(_message.Message):
    __slots__ = ("index", "files", "file", "offset", "length", "crc32c")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    index: _containers.RepeatedScalarFieldContainer[int]
    files: _containers.RepeatedScalarFieldContainer[str]
    file: _containers.RepeatedScalarFieldContainer[int]
    offset: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[_Iterable[int]] = ..., files: _Optional[_Iterable[str]] = ..., file: _Optional[_Iterable[int]] = ..., offset: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class LaneGetResponse(_message.Message):
    __slots__ = ("grant_id", "blocks", "handled", "last", "crcs_at_copy", "written_direct", "written", "named", "disk")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HANDLED_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CRCS_AT_COPY_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_DIRECT_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    grant_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockDescriptor]
    handled: int
    last: bool
    crcs_at_copy: bool
    written_direct: bool
    written: WrittenBlocks
    named: NamedBlocks
    disk: DiskBlocks
    def __init__(self, grant_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockDescriptor, _Mapping]]] = ..., handled: _Optional[int] = ..., last: _Optional[bool] = ..., crcs_at_copy: _Optional[bool] = ..., written_direct: _Optional[bool] = ..., written: _Optional[_Union[WrittenBlocks, _Mapping]] = ..., named: _Optional[_Union[NamedBlocks, _Mapping]] = ..., disk: _Optional[_Union[DiskBlocks, _Mapping]] = ...) -> None: ...

class LaneTouch(_message.Message):
    __slots__ = ("lane", "touched", "release")
    LANE_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    lane: LaneRef
    touched: _containers.RepeatedCompositeFieldContainer[TouchedBlocks]
    release: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lane: _Optional[_Union[LaneRef, _Mapping]] = ..., touched: _Optional[_Iterable[_Union[TouchedBlocks, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ...) -> None: ...

class TouchedBlocks(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LanePool(_message.Message):
    __slots__ = ("lane", "fd", "address", "length")
    LANE_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    lane: LaneRef
    fd: int
    address: int
    length: int
    def __init__(self, lane: _Optional[_Union[LaneRef, _Mapping]] = ..., fd: _Optional[int] = ..., address: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class CloseLaneRequest(_message.Message):
    __slots__ = ("lane",)
    LANE_FIELD_NUMBER: _ClassVar[int]
    lane: LaneRef
    def __init__(self, lane: _Optional[_Union[LaneRef, _Mapping]] = ...) -> None: ...

class CloseLaneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TcpHello(_message.Message):
    __slots__ = ("lane", "unordered_data")
    LANE_FIELD_NUMBER: _ClassVar[int]
    UNORDERED_DATA_FIELD_NUMBER: _ClassVar[int]
    lane: LaneRef
    unordered_data: bool
    def __init__(self, lane: _Optional[_Union[LaneRef, _Mapping]] = ..., unordered_data: _Optional[bool] = ...) -> None: ...

class TcpPut(_message.Message):
    __slots__ = ("namespace", "headers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    headers: _containers.RepeatedCompositeFieldContainer[_kvstore_pb2.BlockHeader]
    def __init__(self, namespace: _Optional[str] = ..., headers: _Optional[_Iterable[_Union[_kvstore_pb2.BlockHeader, _Mapping]]] = ...) -> None: ...

class TcpGetReply(_message.Message):
    __slots__ = ("headers",)
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    headers: _containers.RepeatedCompositeFieldContainer[_kvstore_pb2.BlockHeader]
    def __init__(self, headers: _Optional[_Iterable[_Union[_kvstore_pb2.BlockHeader, _Mapping]]] = ...) -> None: ...

class LaneStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
