from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: _common_pb2.PromptGroup
    def __init__(self, prompt: _Optional[_Union[_common_pb2.PromptGroup, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sample", "prompt_token_ids")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sample: _common_pb2.Sample
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "rank_offset", "world_size", "group_epoch", "timeout_seconds", "group_prefix", "group_secret", "nccl_unique_id", "announce_stream", "report_stream", "generator_id", "announce_public_key", "report_key", "protocol_version")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SECRET_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_STREAM_FIELD_NUMBER: _ClassVar[int]
    REPORT_STREAM_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    REPORT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    backend: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_epoch: int
    timeout_seconds: float
    group_prefix: str
    group_secret: bytes
    nccl_unique_id: bytes
    announce_stream: str
    report_stream: str
    generator_id: str
    announce_public_key: bytes
    report_key: bytes
    protocol_version: int
    def __init__(self, backend: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_epoch: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., group_prefix: _Optional[str] = ..., group_secret: _Optional[bytes] = ..., nccl_unique_id: _Optional[bytes] = ..., announce_stream: _Optional[str] = ..., report_stream: _Optional[str] = ..., generator_id: _Optional[str] = ..., announce_public_key: _Optional[bytes] = ..., report_key: _Optional[bytes] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ("digest_algorithms", "announced_updates", "protocol_version")
    DIGEST_ALGORITHMS_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    digest_algorithms: _containers.RepeatedScalarFieldContainer[str]
    announced_updates: bool
    protocol_version: int
    def __init__(self, digest_algorithms: _Optional[_Iterable[str]] = ..., announced_updates: _Optional[bool] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "group_epoch", "tensors", "digest_algorithm", "pause_mode")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    version: int
    group_epoch: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    digest_algorithm: str
    pause_mode: str
    def __init__(self, version: _Optional[int] = ..., group_epoch: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., digest_algorithm: _Optional[str] = ..., pause_mode: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("num_tensors", "weights_digest", "received_digests", "digest_algorithm", "busy_seconds")
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    weights_digest: str
    received_digests: _containers.RepeatedScalarFieldContainer[str]
    digest_algorithm: str
    busy_seconds: float
    def __init__(self, num_tensors: _Optional[int] = ..., weights_digest: _Optional[str] = ..., received_digests: _Optional[_Iterable[str]] = ..., digest_algorithm: _Optional[str] = ..., busy_seconds: _Optional[float] = ...) -> None: ...

class UpdateWeightsReport(_message.Message):
    __slots__ = ("generator_id", "version", "group_epoch", "reply", "error")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    version: int
    group_epoch: int
    reply: UpdateWeightsResponse
    error: str
    def __init__(self, generator_id: _Optional[str] = ..., version: _Optional[int] = ..., group_epoch: _Optional[int] = ..., reply: _Optional[_Union[UpdateWeightsResponse, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ("include_weights_hash",)
    INCLUDE_WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    include_weights_hash: bool
    def __init__(self, include_weights_hash: _Optional[bool] = ...) -> None: ...

class RolloutStatusResponse(_message.Message):
    __slots__ = ("generator_id", "version", "paused", "num_inflight_groups", "num_generated_tokens", "num_completed_groups", "weights_digest", "group_epoch", "busy_seconds", "weights_digest_algorithm")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    version: int
    paused: bool
    num_inflight_groups: int
    num_generated_tokens: int
    num_completed_groups: int
    weights_digest: str
    group_epoch: int
    busy_seconds: float
    weights_digest_algorithm: str
    def __init__(self, generator_id: _Optional[str] = ..., version: _Optional[int] = ..., paused: _Optional[bool] = ..., num_inflight_groups: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_completed_groups: _Optional[int] = ..., weights_digest: _Optional[str] = ..., group_epoch: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., weights_digest_algorithm: _Optional[str] = ...) -> None: ...
