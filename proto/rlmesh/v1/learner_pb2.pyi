from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterGeneratorRequest(_message.Message):
    __slots__ = ("generator_id", "address", "num_workers", "version")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    address: str
    num_workers: int
    version: int
    def __init__(self, generator_id: _Optional[str] = ..., address: _Optional[str] = ..., num_workers: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class WeightRendezvous(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "rank_offset", "world_size", "group_epoch")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    backend: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_epoch: int
    def __init__(self, backend: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_epoch: _Optional[int] = ...) -> None: ...

class RegisterGeneratorResponse(_message.Message):
    __slots__ = ("run_id", "version", "rendezvous")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    rendezvous: WeightRendezvous
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., rendezvous: _Optional[_Union[WeightRendezvous, _Mapping]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("generator_id",)
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    def __init__(self, generator_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("generator_id", "version", "num_inflight_groups")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    version: int
    num_inflight_groups: int
    def __init__(self, generator_id: _Optional[str] = ..., version: _Optional[int] = ..., num_inflight_groups: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("version", "registered", "heartbeat_interval_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    registered: bool
    heartbeat_interval_s: float
    def __init__(self, version: _Optional[int] = ..., registered: _Optional[bool] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class GeneratorInfo(_message.Message):
    __slots__ = ("generator_id", "address", "version", "in_group", "seconds_since_heartbeat")
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_GROUP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    generator_id: str
    address: str
    version: int
    in_group: bool
    seconds_since_heartbeat: float
    def __init__(self, generator_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[int] = ..., in_group: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ...) -> None: ...

class LearnerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatusResponse(_message.Message):
    __slots__ = ("run_id", "version", "step", "prompt_queue_depth", "trajectory_queue_depth", "num_inflight_groups", "generators", "num_dropped_stale")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GENERATORS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    step: int
    prompt_queue_depth: int
    trajectory_queue_depth: int
    num_inflight_groups: int
    generators: _containers.RepeatedCompositeFieldContainer[GeneratorInfo]
    num_dropped_stale: int
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., step: _Optional[int] = ..., prompt_queue_depth: _Optional[int] = ..., trajectory_queue_depth: _Optional[int] = ..., num_inflight_groups: _Optional[int] = ..., generators: _Optional[_Iterable[_Union[GeneratorInfo, _Mapping]]] = ..., num_dropped_stale: _Optional[int] = ...) -> None: ...
