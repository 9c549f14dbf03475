"""The whole run config (`RunConfig`, one section per tier, checked across sections) and how it is
read: YAML plus dotted command-line overrides, errors that name the key, secrets redacted on output."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from rlmesh.services.config.base import Section
from rlmesh.services.config.model_data import (
    ArithmeticDataSection, DataSection, ModelSection, RunSection, TinyModelSection,
)
from rlmesh.services.config.prompt import PromptSection
from rlmesh.services.config.reward import RewardSection
from rlmesh.services.config.rollout import RolloutSection
from rlmesh.services.config.training import AlgorithmSection, CheckpointSection, DPOSection, LearnerSection, SFTSection
from rlmesh.services.config.transport import LoggingSection, NetworkSection, QueueSection, WeightSyncSection


class RunConfig(Section):
    run: RunSection = RunSection()
    """Run identity and outputs."""
    model: ModelSection = TinyModelSection()
    """Policy model."""
    data: DataSection = ArithmeticDataSection()
    """Prompt dataset."""
    prompt: PromptSection = PromptSection()
    """How prompts become token ids: the chat template, or plain text for a base model."""
    rollout: RolloutSection = RolloutSection()
    """Rollout servers (vLLM)."""
    reward: RewardSection = RewardSection()
    """Reward servers (environments)."""
    learner: LearnerSection = LearnerSection()
    """Learner (training)."""
    sft: SFTSection = SFTSection()
    """Supervised warm start."""
    dpo: DPOSection = DPOSection()
    """Direct preference optimisation (`rlmesh dpo`)."""
    algorithm: AlgorithmSection = AlgorithmSection()
    """RL algorithm."""
    queue: QueueSection = QueueSection()
    """Redis stream queues."""
    weight_sync: WeightSyncSection = WeightSyncSection()
    """Learner -> rollout weight broadcast."""
    network: NetworkSection = NetworkSection()
    """Addresses and auth."""
    logging: LoggingSection = LoggingSection()
    """Logs and progress."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Checkpointing."""

    @model_validator(mode="before")
    @classmethod
    def _default_tags(cls, data: Any) -> Any:
        # A partial section (`model.hidden_size=64`) keeps the default member of its union.
        if isinstance(data, dict):
            for key, tag in (("model", "tiny"), ("data", "arithmetic")):
                if isinstance(data.get(key), dict):
                    data[key].setdefault("type", tag)
            if isinstance(data.get("learner"), dict) and isinstance(data["learner"].get("backend"), dict):
                data["learner"]["backend"].setdefault("type", "fsdp2")
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.learner.groups_per_step * self.algorithm.group_size < 1:
            raise ValueError("learner.groups_per_step * algorithm.group_size must be >= 1")
        if self.queue.max_len < (self.algorithm.max_staleness + 1) * self.learner.groups_per_step:
            raise ValueError(
                f"queue.max_len={self.queue.max_len} is below the in-flight bound "
                f"(algorithm.max_staleness + 1) * learner.groups_per_step; raise queue.max_len"
            )
        if self.learner.max_tokens_per_micro_batch and self.dpo.num_steps:
            raise ValueError(
                f"learner.max_tokens_per_micro_batch={self.learner.max_tokens_per_micro_batch} sorts sequences by "
                f"length, which would split DPO's (chosen, rejected) pairs (dpo.num_steps={self.dpo.num_steps}); set "
                "learner.max_tokens_per_micro_batch=0 for a DPO run")
        if self.algorithm.kl.coef > 0 and self.learner.backend.type != "fsdp2":
            raise ValueError(
                f"algorithm.kl.coef={self.algorithm.kl.coef} needs a reference model, and the "
                f"{self.learner.backend.type} backend does not build one yet (missing: a frozen, sharded copy of the "
                "starting model and its logprobs pass); use learner.backend.type=fsdp2 or algorithm.kl.coef=0"
            )
        if self.learner.shared_prompt_row_tokens and self.learner.backend.type != "fsdp2":
            raise ValueError(
                f"learner.shared_prompt_row_tokens={self.learner.shared_prompt_row_tokens} packs each prompt once "
                f"with its completions under a custom attention mask, which the {self.learner.backend.type} backend "
                "does not build; use learner.backend.type=fsdp2 or learner.shared_prompt_row_tokens=0")
        if self.learner.lora.rank and self.learner.backend.type != "fsdp2":
            raise ValueError(
                f"learner.lora.rank={self.learner.lora.rank} needs the fsdp2 backend: LoRA through peft is not built "
                f"for learner.backend.type={self.learner.backend.type}; use learner.backend.type=fsdp2 or "
                "learner.lora.rank=0")
        if self.data.type == "verifiers" and self.data.env_name not in self.reward.verifiers:
            raise ValueError(
                f"data.env_name={self.data.env_name!r} names no verifiers environment: reward.verifiers has "
                f"{sorted(self.reward.verifiers) or 'none'}; add reward.verifiers.{self.data.env_name}.env_id")
        if self.learner.lora.rank and self.weight_sync.backend != "gloo":
            raise ValueError(
                f"learner.lora.rank={self.learner.lora.rank} ships adapters through rlmesh's gloo weight engine; "
                f"weight_sync.backend={self.weight_sync.backend} (vLLM's own engine) cannot load one; set "
                "weight_sync.backend=gloo or learner.lora.rank=0")
        return self


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the field and the fix."""


@dataclass(frozen=True)
class _Tagged:
    """A discriminated union in the config tree: its members by tag. Pydantic puts the tag in an
    error's location, after the field's name; it is not a key the user writes."""

    members: dict[Any, Any]


@dataclass(frozen=True)
class _Keyed:
    """A dict (or list) field: any key (or index), then `value`."""

    value: Any


def _node(annotation: Any, discriminator: Any = None) -> Any:
    """What a field's annotation holds, for walking an error location: a model class, a `_Tagged`
    union (`Annotated[Union[...], Field(discriminator=...)]`, also as a field's own discriminator),
    a `_Keyed` container, or None for a plain value."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        inner, *extras = typing.get_args(annotation)
        found = next((x.discriminator for x in extras if isinstance(x, FieldInfo) and x.discriminator), None)
        return _node(inner, found or discriminator)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if isinstance(discriminator, str):
            return _Tagged({tag: m for m in members
                            for tag in typing.get_args(m.model_fields[discriminator].annotation)})
        return _node(members[0]) if len(members) == 1 else None
    if origin in (dict, list):
        return _Keyed(_node(typing.get_args(annotation)[-1]))
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _config_path(loc: tuple[Any, ...]) -> tuple[list[str], Any]:
    """Pydantic's raw error location as the keys a user writes (the union tags it adds dropped),
    and what the location ends in (a model class, or None), read from RunConfig's annotations."""
    keys: list[str] = []
    node: Any = RunConfig
    for part in loc:
        if isinstance(node, _Tagged):
            node = node.members.get(part)
            continue
        keys.append(str(part))
        if isinstance(node, _Keyed):
            node = node.value
        elif isinstance(node, type) and str(part) in node.model_fields:
            field = node.model_fields[str(part)]
            node = _node(field.annotation, field.discriminator)
        else:
            node = None
    return keys, node


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        keys, _ = _config_path(tuple(e["loc"]))
        where = ".".join(keys) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            _, parent = _config_path(tuple(e["loc"][:-1]))
            allowed = sorted(parent.model_fields) if isinstance(parent, type) else None
            msg = f"unknown key '{keys[-1]}'" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            # A section's own check names the keys it is about; echoing the section (the whole config
            # at the root) would bury that line.
            msg = f"{msg} (got {_shown(e['input'])})"
        lines.append(f"  {where}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def _shown(value: Any, limit: int = 200) -> str:
    """A rejected value as an error shows it: a URL's password masked, long values cut."""
    if isinstance(value, str) and "://" in value:
        try:
            value = redact_url(value)
        except ValueError:  # not a URL after all (or one urlsplit cannot take): shown as given
            pass
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. learner.lr=1e-4)")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key segment")
    try:
        return path, load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(err)}); quote it "
                          "to pass it as a string, e.g. key='[text'") from None


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last one
    silently: a second `learner:` section would drop the first's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue  # config keys are scalars; a composite key is left to the config's validation
            if (key_node.tag, key_node.value) in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key_node.value!r} is given twice in one mapping (only one would count)",
                    key_node.start_mark)
            seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """YAML as `yaml.safe_load` reads it, but a key given twice in one mapping is an error."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, from 1)."""
    mark = getattr(err, "problem_mark", None)
    what = getattr(err, "problem", None) or str(err)
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def set_path(data: dict[str, Any], path: list[str], value: Any, what: str) -> None:
    """Set `data[path[0]][path[1]]... = value`, creating sections; `what` names the override in errors."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {what}: '{part}' is a value, not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        set_path(data, path, value, repr(text))
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping, not yet validated."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        loaded = load_yaml(p.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(err)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return loaded or {}


def validate_config(data: dict[str, Any]) -> RunConfig:
    """A RunConfig from a mapping; raises ConfigError with a readable message."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (if given), apply overrides, validate. Raises ConfigError with a readable message."""
    data = read_config_file(path) if path is not None else {}
    apply_overrides(data, overrides or [])
    return validate_config(data)


REDACTED = "***"


def redact_url(url: str) -> str:
    """`url` with any password in it replaced by `***`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}{REDACTED}@{host}"))


def public_dict(config: RunConfig) -> dict[str, Any]:
    """The config as written to run directories and printed: secrets never appear (a password in
    queue.url is redacted; tokens and passwords are only ever read from files or the environment)."""
    data = config.model_dump(mode="json")
    data["queue"]["url"] = redact_url(data["queue"]["url"])
    return data


def dump_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(public_dict(config), sort_keys=False))
