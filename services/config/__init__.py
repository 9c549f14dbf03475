"""The run config: one pydantic model with a section per tier, loaded from YAML plus dotted
command-line overrides (`learner.lr=1e-6`). Imports neither torch nor vLLM.

Each tier's sections live in a module of their own (model_data, rollout, reward, training,
transport); `run_config` joins them into `RunConfig` and reads, validates and writes it. Every name
is imported from here: `from rlmesh.services.config import RunConfig, load_config`."""

from __future__ import annotations

from rlmesh.services.config.base import Section, default
from rlmesh.services.config.model_data import (
    RunSection, TinyModelSection, HFModelSection, ModelSection, ArithmeticDataSection, JsonlDataSection,
    CalculatorDataSection, HFDataSection, ReasoningGymDataSection, TextArenaDataSection, VerifiersDataSection,
    DataSection,
)
from rlmesh.services.config.prompt import PromptSection
from rlmesh.services.config.rollout import (
    AgentEndpointSection, EpisodeSection, RolloutSection,
)
from rlmesh.services.config.reward import (
    McpEnvironmentSection, CodeEnvironmentSection, JudgeEnvironmentSection, OpenEnvEnvironmentSection,
    MathEnvironmentSection, VerifiersEnvironmentSection, RewardSection,
)
from rlmesh.services.config.training import (
    LoRASection, StallSection, FSDP2BackendSection, MegatronBackendSection, BackendSection, LearnerSection, SFTSection,
    DPOSection, OffPolicySection, KLSection, CreditSection, AlgorithmSection, CheckpointSection,
)
from rlmesh.services.config.transport import (
    QueueSection, WeightSyncSection, TLSSection, LimitsSection, NetworkSection, LoggingSection,
)
from rlmesh.services.config.run_config import (
    RunConfig, ConfigError, REDACTED, format_validation_error, parse_override, set_path, apply_overrides,
    read_config_file, validate_config, load_config, redact_url, public_dict, dump_config,
)

__all__ = [
    "Section", "default", "RunSection", "TinyModelSection", "HFModelSection", "ModelSection", "ArithmeticDataSection",
    "JsonlDataSection", "CalculatorDataSection", "HFDataSection", "ReasoningGymDataSection", "TextArenaDataSection", "VerifiersDataSection", "DataSection", "PromptSection", "EpisodeSection", "AgentEndpointSection",
    "RolloutSection", "McpEnvironmentSection", "CodeEnvironmentSection", "JudgeEnvironmentSection",
    "OpenEnvEnvironmentSection", "MathEnvironmentSection", "VerifiersEnvironmentSection", "RewardSection", "LoRASection", "StallSection",
    "FSDP2BackendSection", "MegatronBackendSection", "BackendSection", "LearnerSection", "SFTSection",
    "DPOSection", "OffPolicySection", "KLSection", "CreditSection", "AlgorithmSection", "CheckpointSection", "QueueSection",
    "WeightSyncSection", "TLSSection", "LimitsSection", "NetworkSection", "LoggingSection", "RunConfig",
    "ConfigError", "REDACTED", "format_validation_error", "parse_override", "set_path", "apply_overrides",
    "read_config_file", "validate_config", "load_config", "redact_url", "public_dict", "dump_config",
]
