from google.protobuf import struct_pb2 as _struct_pb2
from rlmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("id", "env_name", "prompt", "completion", "completion_token_ids", "env_metadata")
    ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENV_METADATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    env_name: str
    prompt: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    completion: str
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    env_metadata: _struct_pb2.Struct
    def __init__(self, id: _Optional[str] = ..., env_name: _Optional[str] = ..., prompt: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., completion: _Optional[str] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., env_metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "reward", "components", "error")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    reward: float
    components: _containers.ScalarMap[str, float]
    error: str
    def __init__(self, id: _Optional[str] = ..., reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env_name", "env_metadata", "prompt")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_METADATA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    env_metadata: _struct_pb2.Struct
    prompt: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, env_name: _Optional[str] = ..., env_metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., prompt: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "observation", "tools")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    def __init__(self, session_id: _Optional[str] = ..., observation: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: _common_pb2.ChatMessage
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[_Union[_common_pb2.ChatMessage, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "metadata", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    observation: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    reward: float
    done: bool
    metadata: _struct_pb2.Struct
    components: _containers.ScalarMap[str, float]
    def __init__(self, observation: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("reset", "step")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    reset: ResetRequest
    step: StepRequest
    def __init__(self, reset: _Optional[_Union[ResetRequest, _Mapping]] = ..., step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("reset", "step")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    reset: ResetResponse
    step: StepResponse
    def __init__(self, reset: _Optional[_Union[ResetResponse, _Mapping]] = ..., step: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "kind", "description", "remote_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    description: str
    remote_address: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., description: _Optional[str] = ..., remote_address: _Optional[str] = ...) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments",)
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ...) -> None: ...

class RegisterEnvironmentRequest(_message.Message):
    __slots__ = ("name", "address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterEnvironmentResponse(_message.Message):
    __slots__ = ("environment",)
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    environment: EnvironmentInfo
    def __init__(self, environment: _Optional[_Union[EnvironmentInfo, _Mapping]] = ...) -> None: ...

class RunAgentRequest(_message.Message):
    __slots__ = ("env_name", "prompt", "env_metadata", "base_url", "api_key")
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ENV_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    env_name: str
    prompt: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    env_metadata: _struct_pb2.Struct
    base_url: str
    api_key: str
    def __init__(self, env_name: _Optional[str] = ..., prompt: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., env_metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., base_url: _Optional[str] = ..., api_key: _Optional[str] = ...) -> None: ...

class RunAgentResponse(_message.Message):
    __slots__ = ("reward", "components", "error", "turn_rewards")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.ScalarMap[str, float]
    error: str
    turn_rewards: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., turn_rewards: _Optional[_Iterable[float]] = ...) -> None: ...
