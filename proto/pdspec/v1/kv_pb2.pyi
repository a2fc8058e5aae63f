from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheShape(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "target", "draft", "draft_model")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    target: CacheShape
    draft: CacheShape
    draft_model: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., target: _Optional[_Union[CacheShape, _Mapping]] = ..., draft: _Optional[_Union[CacheShape, _Mapping]] = ..., draft_model: _Optional[str] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "source_worker_id", "source_address", "layout", "block_ids", "num_prompt_tokens", "first_token", "seed", "draft_hidden", "cached_prompt_tokens", "queue_seconds", "nixl_agent", "pin_id", "block_checksums", "nixl_metadata_sha256")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_SHA256_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_worker_id: str
    source_address: str
    layout: KVLayout
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    first_token: int
    seed: int
    draft_hidden: bytes
    cached_prompt_tokens: int
    queue_seconds: float
    nixl_agent: str
    pin_id: str
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    nixl_metadata_sha256: bytes
    def __init__(self, request_id: _Optional[str] = ..., source_worker_id: _Optional[str] = ..., source_address: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., seed: _Optional[int] = ..., draft_hidden: _Optional[bytes] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., nixl_agent: _Optional[str] = ..., pin_id: _Optional[str] = ..., block_checksums: _Optional[_Iterable[int]] = ..., nixl_metadata_sha256: _Optional[bytes] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "expected_layout", "pin_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    expected_layout: KVLayout
    pin_id: str
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., expected_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., pin_id: _Optional[str] = ...) -> None: ...

class KVBlockChunk(_message.Message):
    __slots__ = ("block_id", "cache", "data", "checksum")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    cache: str
    data: bytes
    checksum: int
    def __init__(self, block_id: _Optional[int] = ..., cache: _Optional[str] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class NixlMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NixlRegion(_message.Message):
    __slots__ = ("cache", "base_address", "length", "block_bytes", "device_id", "memory_type")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    base_address: int
    length: int
    block_bytes: int
    device_id: int
    memory_type: str
    def __init__(self, cache: _Optional[str] = ..., base_address: _Optional[int] = ..., length: _Optional[int] = ..., block_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., memory_type: _Optional[str] = ...) -> None: ...

class NixlMetadataResponse(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "regions", "layout")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[NixlRegion]
    layout: KVLayout
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[NixlRegion, _Mapping]]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "pin_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pin_id: str
    def __init__(self, request_id: _Optional[str] = ..., pin_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
