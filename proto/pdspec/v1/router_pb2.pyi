from proto.pdspec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MessageList(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "prompt", "token_ids", "sampling", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: MessageList
    prompt: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingOptions
    speculation: _common_pb2.SpeculationOptions
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Union[MessageList, _Mapping]] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationOptions, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "acceptance", "prefill_worker", "decode_worker")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: _common_pb2.Usage
    acceptance: _common_pb2.Acceptance
    prefill_worker: str
    decode_worker: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., acceptance: _Optional[_Union[_common_pb2.Acceptance, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "address", "active_blocks", "total_blocks", "running", "waiting", "cached_blocks", "seconds_since_heartbeat", "metrics_address", "registration_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    active_blocks: int
    total_blocks: int
    running: int
    waiting: int
    cached_blocks: int
    seconds_since_heartbeat: float
    metrics_address: str
    registration_id: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., active_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., metrics_address: _Optional[str] = ..., registration_id: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...
