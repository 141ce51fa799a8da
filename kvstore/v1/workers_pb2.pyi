from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Prompt(_message.Message):
    __slots__ = ("text", "tokens", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    chat: bool
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("prompt", "namespace")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    namespace: str
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., namespace: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("lookup_s", "transfer_s", "load_s", "compute_s", "total_s")
    LOOKUP_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    lookup_s: float
    transfer_s: float
    load_s: float
    compute_s: float
    total_s: float
    def __init__(self, lookup_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., load_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("hashes", "prompt_tokens", "cached_blocks", "computed_tokens", "stored_blocks", "transfer_bytes", "timings")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    cached_blocks: int
    computed_tokens: int
    stored_blocks: int
    transfer_bytes: int
    timings: Timings
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "namespace", "max_new_tokens", "use_store")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USE_STORE_FIELD_NUMBER: _ClassVar[int]
    prompt: Prompt
    namespace: str
    max_new_tokens: int
    use_store: bool
    def __init__(self, prompt: _Optional[_Union[Prompt, _Mapping]] = ..., namespace: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., use_store: _Optional[bool] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("token_ids", "text", "first", "prompt_tokens", "cached_blocks", "transfer_bytes", "recomputed", "timings")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    first: bool
    prompt_tokens: int
    cached_blocks: int
    transfer_bytes: int
    recomputed: bool
    timings: Timings
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., first: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., recomputed: _Optional[bool] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...
