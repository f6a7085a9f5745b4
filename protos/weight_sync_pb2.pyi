from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENCODING_RAW: _ClassVar[Encoding]
    ENCODING_XOR_ZSTD: _ClassVar[Encoding]
    ENCODING_SPARSE: _ClassVar[Encoding]
ENCODING_RAW: Encoding
ENCODING_XOR_ZSTD: Encoding
ENCODING_SPARSE: Encoding

class ProtocolVersion(_message.Message):
    __slots__ = ("major", "minor")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    major: int
    minor: int
    def __init__(self, major: _Optional[int] = ..., minor: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("manifest", "policy_version", "max_chunk_bytes", "delta_supported", "data_port", "protocol_version", "shm_plane", "lora_alpha")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_PLANE_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    manifest: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    policy_version: int
    max_chunk_bytes: int
    delta_supported: bool
    data_port: int
    protocol_version: ProtocolVersion
    shm_plane: ShmPlane
    lora_alpha: float
    def __init__(self, manifest: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., policy_version: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., delta_supported: _Optional[bool] = ..., data_port: _Optional[int] = ..., protocol_version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., shm_plane: _Optional[_Union[ShmPlane, _Mapping]] = ..., lora_alpha: _Optional[float] = ...) -> None: ...

class ShmPlane(_message.Message):
    __slots__ = ("host_id", "socket_name", "pid", "uid")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SOCKET_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    socket_name: str
    pid: int
    uid: int
    def __init__(self, host_id: _Optional[str] = ..., socket_name: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ...) -> None: ...

class BeginRequest(_message.Message):
    __slots__ = ("session_id", "policy_version", "rank", "num_ranks", "tensors", "base_version", "num_streams", "relay_targets", "relay_fanout", "protocol_version", "drop_base", "lora_alpha")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    RELAY_TARGETS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FANOUT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DROP_BASE_FIELD_NUMBER: _ClassVar[int]
    LORA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    rank: int
    num_ranks: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    base_version: int
    num_streams: int
    relay_targets: _containers.RepeatedCompositeFieldContainer[RelayTarget]
    relay_fanout: int
    protocol_version: ProtocolVersion
    drop_base: bool
    lora_alpha: float
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., rank: _Optional[int] = ..., num_ranks: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., base_version: _Optional[int] = ..., num_streams: _Optional[int] = ..., relay_targets: _Optional[_Iterable[_Union[RelayTarget, _Mapping]]] = ..., relay_fanout: _Optional[int] = ..., protocol_version: _Optional[_Union[ProtocolVersion, _Mapping]] = ..., drop_base: _Optional[bool] = ..., lora_alpha: _Optional[float] = ...) -> None: ...

class BeginReply(_message.Message):
    __slots__ = ("update_id", "current_version", "delta_accepted", "data_ticket", "committed_session_id")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    current_version: int
    delta_accepted: bool
    data_ticket: bytes
    committed_session_id: str
    def __init__(self, update_id: _Optional[str] = ..., current_version: _Optional[int] = ..., delta_accepted: _Optional[bool] = ..., data_ticket: _Optional[bytes] = ..., committed_session_id: _Optional[str] = ...) -> None: ...

class ShardHeader(_message.Message):
    __slots__ = ("name", "offsets", "shape", "xxh3_64")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    XXH3_64_FIELD_NUMBER: _ClassVar[int]
    name: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    xxh3_64: int
    def __init__(self, name: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., xxh3_64: _Optional[int] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("shard", "element_offset", "num_elements", "encoding")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    shard: ShardHeader
    element_offset: int
    num_elements: int
    encoding: Encoding
    def __init__(self, shard: _Optional[_Union[ShardHeader, _Mapping]] = ..., element_offset: _Optional[int] = ..., num_elements: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class RelayResult(_message.Message):
    __slots__ = ("address", "code", "message")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    address: str
    code: int
    message: str
    def __init__(self, address: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("bytes_received", "num_shards", "relayed")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    num_shards: int
    relayed: _containers.RepeatedCompositeFieldContainer[RelayResult]
    def __init__(self, bytes_received: _Optional[int] = ..., num_shards: _Optional[int] = ..., relayed: _Optional[_Iterable[_Union[RelayResult, _Mapping]]] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("session_id", "policy_version", "rank", "ticket", "relay", "fanout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    FANOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    rank: int
    ticket: bytes
    relay: _containers.RepeatedCompositeFieldContainer[RelayTarget]
    fanout: int
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., rank: _Optional[int] = ..., ticket: _Optional[bytes] = ..., relay: _Optional[_Iterable[_Union[RelayTarget, _Mapping]]] = ..., fanout: _Optional[int] = ...) -> None: ...

class RelayTarget(_message.Message):
    __slots__ = ("address", "data_port", "ticket")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    address: str
    data_port: int
    ticket: bytes
    def __init__(self, address: _Optional[str] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class DataReply(_message.Message):
    __slots__ = ("code", "message", "reply", "unopened")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    UNOPENED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reply: PushReply
    unopened: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reply: _Optional[_Union[PushReply, _Mapping]] = ..., unopened: _Optional[bool] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "policy_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("policy_version", "apply_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    apply_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., apply_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "policy_version", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class WatchVersionRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...
