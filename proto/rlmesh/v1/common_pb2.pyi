from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids", "loss_mask")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[bool]] = ...) -> None: ...

class SamplingOverrides(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "run_id", "messages", "prompt_tokens", "env_name", "env_metadata", "n", "sampling", "issued_at_version", "split", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_METADATA_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    run_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_tokens: TokenSequence
    env_name: str
    env_metadata: _struct_pb2.Struct
    n: int
    sampling: SamplingOverrides
    issued_at_version: int
    split: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, group_id: _Optional[str] = ..., run_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_tokens: _Optional[_Union[TokenSequence, _Mapping]] = ..., env_name: _Optional[str] = ..., env_metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOverrides, _Mapping]] = ..., issued_at_version: _Optional[int] = ..., split: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("index", "completion", "logprobs", "finish_reason", "min_version", "max_version", "reward", "reward_components", "error", "text", "num_turns", "turns")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    index: int
    completion: TokenSequence
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    min_version: int
    max_version: int
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    error: str
    text: str
    num_turns: int
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    def __init__(self, index: _Optional[int] = ..., completion: _Optional[_Union[TokenSequence, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., text: _Optional[str] = ..., num_turns: _Optional[int] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("start", "num_sampled_tokens", "num_env_tokens", "min_version", "max_version", "finish_reason", "env_seconds", "reward")
    START_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    start: int
    num_sampled_tokens: int
    num_env_tokens: int
    min_version: int
    max_version: int
    finish_reason: str
    env_seconds: float
    reward: float
    def __init__(self, start: _Optional[int] = ..., num_sampled_tokens: _Optional[int] = ..., num_env_tokens: _Optional[int] = ..., min_version: _Optional[int] = ..., max_version: _Optional[int] = ..., finish_reason: _Optional[str] = ..., env_seconds: _Optional[float] = ..., reward: _Optional[float] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "run_id", "prompt", "prompt_token_ids", "samples", "generator_id", "generation_seconds", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    run_id: str
    prompt: PromptGroup
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    generator_id: str
    generation_seconds: float
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, group_id: _Optional[str] = ..., run_id: _Optional[str] = ..., prompt: _Optional[_Union[PromptGroup, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., generator_id: _Optional[str] = ..., generation_seconds: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PolicyVersion(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
