"""The run, model and data sections of the run config: what is trained, on which prompts."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from rlmesh.services.config.base import Section


class RunSection(Section):
    name: str = "rlmesh"
    """Human name of the run; the run directory is `<output_dir>/<name>-<timestamp>`."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """Seed for data generation, model init and sampling."""
    max_restarts: int = Field(3, ge=0)
    """Times `rlmesh up` restarts a crashed service (with exponential backoff) before failing the run."""


TinyArch = Literal["qwen2", "llama", "qwen3", "gemma3", "mistral", "phi3", "olmo2", "qwen2_moe", "qwen3_moe", "mixtral"]


class TinyModelSection(Section):
    type: Literal["tiny"] = "tiny"
    """Write a tiny random-initialised model (real architecture, real tokenizer) into the run dir."""
    arch: TinyArch = "qwen2"
    """HF architecture of the tiny model (the model-family matrix builds one of each: docs/models.md)."""
    hidden_size: int = Field(128, gt=0)
    """Model width."""
    num_layers: int = Field(2, gt=0)
    """Number of decoder layers."""
    num_heads: int = Field(2, gt=0)
    """Attention heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = Field(1, gt=0)
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(256, gt=0)
    """MLP width."""
    tokenizer: Literal["bytes", "bpe"] = "bytes"
    """bytes: every byte one token (no merges); bpe: byte-level BPE with merges learned from the tasks' text."""
    bpe_vocab_size: int = Field(512, ge=300)
    """Vocabulary size of the `bpe` tokenizer (256 bytes + 3 special tokens + merges)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelSection:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model: hidden_size={self.hidden_size} must be divisible by num_heads="
                f"{self.num_heads}, and num_heads by num_kv_heads={self.num_kv_heads}"
            )
        return self


class HFModelSection(Section):
    type: Literal["hf"] = "hf"
    """Load an existing Hugging Face model."""
    path: str
    """Local directory (or hub name, where a hub is reachable) of the model."""
    allow_untested_architecture: bool = False
    """Start even when the model's architecture is not one the family matrix proves (services/model_families.py; docs/models.md): its in-place weight updates are then unproven, though an update that leaves a layer unloaded still fails."""


ModelSection = Annotated[Union[TinyModelSection, HFModelSection], Field(discriminator="type")]


class ArithmeticDataSection(Section):
    type: Literal["arithmetic"] = "arithmetic"
    """Generated arithmetic problems ("What is 3+4?") with exact answers."""
    num_train: int = Field(2000, gt=0)
    """Training prompts."""
    num_eval: int = Field(200, gt=0)
    """Held-out prompts (disjoint from training)."""
    max_operand: int = Field(9, ge=1)
    """Operands are drawn from [0, max_operand]."""
    ops: list[Literal["+", "-", "*"]] = ["+"]
    """Operators to draw from."""
    env_name: str = "arithmetic"
    """Environment that scores these prompts (e.g. a reward function registered under `reward.functions`)."""


class JsonlDataSection(Section):
    type: Literal["jsonl"] = "jsonl"
    """Prompts from JSONL files: one object per line with chat messages (or a plain prompt) and metadata."""
    train_path: str
    """Training prompts."""
    eval_path: str
    """Held-out prompts."""
    messages_key: str = "messages"
    """Field holding the full chat message list ([{role, content}, ...]); takes precedence over prompt_key."""
    prompt_key: str = "prompt"
    """Field holding a plain user prompt (used when a row has no messages)."""
    metadata_key: str = "metadata"
    """Field holding the environment's metadata object; without it, every other field of the row is the metadata."""
    answer_key: str = "answer"
    """Field holding the reference answer; copied to metadata.answer when it is named otherwise."""
    chosen_key: str = "chosen"
    """For `rlmesh dpo`: field holding the preferred assistant turn (a string, or TRL's conversational form: a list of messages ending in the assistant's)."""
    rejected_key: str = "rejected"
    """For `rlmesh dpo`: field holding the dispreferred assistant turn (same forms as chosen_key)."""
    env_name: str = "arithmetic"
    """Environment that scores these prompts (a row's own "env" field overrides it)."""


class CalculatorDataSection(Section):
    type: Literal["calculator"] = "calculator"
    """Generated tool-use problems ("What is 123 + 456?") for the `calculator` environment and its `add` tool."""
    num_train: int = Field(2000, gt=0)
    """Training prompts."""
    num_eval: int = Field(40, gt=0)
    """Held-out prompts (operand pairs disjoint from training)."""
    min_operand: int = Field(100, ge=0)
    """Operands are drawn from [min_operand, max_operand]: large enough that a tiny model cannot add them in its weights."""
    max_operand: int = Field(999, ge=1)
    """Largest operand."""
    tool_call_reward: float = Field(0.0, ge=0, le=1)
    """A turn reward for the episode's first `add` call whose result is the answer, beside the final answer's 1 (the calculator's `tool_call_reward` metadata): turns rewarded apart, for per-turn credit (`algorithm.credit.assign`). 0: only the answer is rewarded."""
    env_name: str = "calculator"
    """Environment that runs the episodes (a multi-turn environment with an `add` tool)."""

    @model_validator(mode="after")
    def _range(self) -> CalculatorDataSection:
        if self.max_operand < self.min_operand:
            raise ValueError(f"data.max_operand={self.max_operand} is below data.min_operand={self.min_operand}")
        return self


class HFDataSection(Section):
    type: Literal["hf"] = "hf"
    """Prompts through Hugging Face `datasets`: local data files, a saved dataset directory, or a hub dataset."""
    path: str
    """A data file or glob (.jsonl, .json, .parquet, .arrow, .csv), a directory written by `save_to_disk`, a directory of data files, or a hub dataset name (where a hub is reachable)."""
    name: str | None = None
    """Hub dataset configuration (e.g. `main` for openai/gsm8k)."""
    split: str = "train"
    """Split trained on."""
    eval_path: str | None = None
    """Where the held-out split is, in the same forms as `path` (unset: `path`; required when `path` is a single data file or glob)."""
    eval_split: str = "test"
    """Held-out split."""
    num_train: int | None = Field(None, gt=0)
    """Use only the first N training rows (unset: all)."""
    num_eval: int | None = Field(None, gt=0)
    """Use only the first N held-out rows (unset: all); eval rows are always held in memory."""
    streaming: bool = False
    """Read training rows as a stream (for files too big for memory): shuffled through a seeded buffer (`shuffle_buffer`), never indexed."""
    shuffle: bool = True
    """Reshuffle the training rows every epoch, seeded by run.seed and the epoch (false: file order)."""
    shuffle_buffer: int = Field(10000, ge=1)
    """Rows in the shuffle buffer when streaming."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (a user message); used when a row has no `messages_key` column."""
    messages_key: str = "messages"
    """Column holding the chat messages ([{role, content}, ...]); takes precedence over prompt_key."""
    prompt_template: str | None = None
    """Text the prompt column is put into at `{prompt}`, e.g. `{prompt} Put the final answer in \\boxed{}.` (unset: the text alone)."""
    system_prompt: str | None = None
    """A system message put before the prompt (unless the row's messages start with one)."""
    answer_key: str = "answer"
    """Column holding the reference answer: the environment's metadata.answer, and the SFT target (e.g. GSM8K's worked solution ending in `#### 42`)."""
    metadata_keys: list[str] | None = None
    """Columns passed to the environment as metadata (unset: every column but the prompt, messages, chosen and rejected ones)."""
    chosen_key: str = "chosen"
    """For `rlmesh dpo`: column holding the preferred assistant turn (a string, or a list of messages ending in the assistant's)."""
    rejected_key: str = "rejected"
    """For `rlmesh dpo`: column holding the dispreferred assistant turn (same forms as chosen_key)."""
    id_key: str | None = None
    """Column holding a row id (unset: `<split>-<row number>`)."""
    env_name: str = "math"
    """Environment that scores these prompts."""
    env_key: str | None = None
    """Column naming a row's own environment, overriding env_name (unset: every row uses env_name)."""

    @model_validator(mode="after")
    def _template_has_the_prompt(self) -> HFDataSection:
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ValueError(f"data.prompt_template={self.prompt_template!r} has no {{prompt}} to put the prompt "
                             "column's text at (every prompt would be this same text)")
        return self


class ReasoningGymDataSection(Section):
    type: Literal["reasoning_gym"] = "reasoning_gym"
    """Generated tasks from a reasoning-gym dataset (`pip install rlmesh[envs]`), scored by its own scorer in the `reasoning_gym` environment."""
    dataset: str
    """reasoning-gym dataset name, as `reasoning_gym.create_dataset` takes it (e.g. `basic_arithmetic`, `leg_counting`)."""
    settings: dict[str, Any] = {}
    """The dataset's own config fields, passed through (e.g. `{min_terms: 2, max_terms: 2, max_digits: 1}`); not `seed` or `size`."""
    num_train: int = Field(2000, gt=0)
    """Training prompts (distinct questions)."""
    num_eval: int = Field(100, gt=0)
    """Held-out prompts: distinct questions, none of which is a training question."""
    seed: int | None = None
    """Seed of the generator (unset: run.seed)."""
    system_prompt: str | None = "default"
    """A system message: the name of one of reasoning-gym's prompts (`default`, `direct`, `simple`, `chain_of_draft`, `DeepSeekZero`; each asks for the answer in `<answer></answer>`, which the environment reads), or null for none."""
    prompt_template: str = "{question}"
    """Text the question is put into at `{question}`, as the user message (e.g. `{question} Give the answer in <answer></answer> tags.`)."""
    num_shots: int = Field(0, ge=0)
    """Solved examples put before every question as earlier turns (the question, then `<answer>answer</answer>` as the assistant's): questions of their own, in neither split; for a small model that does not use the tags unshown."""
    env_name: str = "reasoning_gym"
    """Environment that scores these prompts."""

    @model_validator(mode="after")
    def _settings_leave_seed_and_size(self) -> ReasoningGymDataSection:
        taken = sorted({"seed", "size"} & set(self.settings))
        if taken:
            raise ValueError(f"data.settings sets {', '.join(taken)}; use data.seed and data.num_train / "
                             "data.num_eval instead")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"data.prompt_template={self.prompt_template!r} has no {{question}} to put the question at")
        return self


class TextArenaDataSection(Section):
    type: Literal["textarena"] = "textarena"
    """Episodes of a TextArena single-player game (`pip install rlmesh[games]`), played turn by turn in the `textarena` environment."""
    game: str
    """TextArena game id, as `textarena.make` takes it (e.g. `GuessTheNumber-v0`, `TowerOfHanoi-v0`, `Minesweeper-v0-small`)."""
    num_train: int = Field(1000, gt=0)
    """Training episodes: one game seed each."""
    num_eval: int = Field(50, gt=0)
    """Held-out episodes: game seeds none of the training episodes uses."""
    seed: int | None = None
    """First game seed (unset: run.seed * 1,000,003): held-out episodes take the next `num_eval` seeds, training the `num_train` after them."""
    system_prompt: str | None = None
    """A system message before the game's own rules (which are the first user message); null for none."""
    env_name: str = "textarena"
    """Environment that plays these episodes."""


class VerifiersDataSection(Section):
    type: Literal["verifiers"] = "verifiers"
    """Prompts from a `verifiers` environment's own dataset, played or scored by that environment (`reward.verifiers.ENV_NAME`)."""
    env_name: str
    """The environment (a key of reward.verifiers) whose dataset this is and which serves these prompts."""
    num_train: int = Field(1000, gt=0)
    """Training prompts (at most what the dataset has)."""
    num_eval: int = Field(50, gt=0)
    """Held-out prompts: from the environment's eval dataset, or, where it has none, the first of its shuffled dataset (never trained on)."""
    seed: int | None = None
    """Shuffle seed of the dataset (unset: run.seed)."""


DataSection = Annotated[
    Union[ArithmeticDataSection, JsonlDataSection, CalculatorDataSection, HFDataSection, ReasoningGymDataSection,
          TextArenaDataSection, VerifiersDataSection],
    Field(discriminator="type"),
]
