"""The run config: one pydantic model with a section per tier, loaded from YAML plus dotted
command-line overrides (`learner.lr=1e-6`). Imports neither torch nor vLLM."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str = "rlmesh"
    """Human name of the run; the run directory is `<output_dir>/<name>-<timestamp>`."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    seed: int = 0
    """Seed for data generation, model init and sampling."""
    max_restarts: int = Field(3, ge=0)
    """Times `rlmesh up` restarts a crashed service (with exponential backoff) before failing the run."""


class TinyModelSection(Section):
    type: Literal["tiny"] = "tiny"
    """Write a tiny random-initialised model (real architecture, real tokenizer) into the run dir."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """HF architecture of the tiny model."""
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


DataSection = Annotated[
    Union[ArithmeticDataSection, JsonlDataSection, CalculatorDataSection, HFDataSection], Field(discriminator="type")
]


class EpisodeSection(Section):
    max_turns: int = Field(8, ge=1)
    """Model turns of one multi-turn episode; past it the episode ends (finish_reason `max_turns`)."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Prompt plus every turn's tokens; each turn's generation is capped to fit (unset: rollout.max_model_len)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one environment Reset or Step call; past it the episode fails with reason `step_timeout`."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Deadline of a whole episode (generation and environment); past it the episode fails with `episode_timeout`."""
    on_error: Literal["drop", "penalize"] = "drop"
    """A failed episode (environment error, timeout) is dropped from training (`drop`), or trained with `error_reward` (`penalize`)."""
    error_reward: float = 0.0
    """Reward of a failed episode under on_error=penalize."""


class RolloutSection(Section):
    num_servers: int = Field(1, ge=1)
    """Rollout servers `rlmesh up` starts."""
    max_concurrent_groups: int = Field(64, ge=1)
    """Prompt groups one server generates at once (vLLM batches them)."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; only 1 is accepted (see the validator: truncated-distribution logprobs bias the importance ratio)."""
    max_tokens: int = Field(16, ge=1)
    """Completion length cap."""
    max_n: int = Field(256, ge=1)
    """Completions one Generate call may ask for (`prompt.n`); more is INVALID_ARGUMENT."""
    max_model_len: int = Field(256, ge=16)
    """vLLM context length."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """vLLM weights dtype (float32 keeps CPU logprobs close to the learner's)."""
    enforce_eager: bool = True
    """Skip torch.compile / graphs (much faster start-up on CPU)."""
    enable_prefix_caching: bool = False
    """Reuse the KV of shared prompt prefixes (the n samples of a group, shared system prompts); the cache is reset at every weight update, so KV computed by old weights is never reused."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_cores: str = "auto"
    """Cores vLLM's CPU worker binds its threads to (VLLM_CPU_OMP_THREADS_BIND): '0', '0-3' or 'auto'."""
    episode: EpisodeSection = EpisodeSection()
    """Multi-turn episodes (environments whose kind is multi_turn): budgets and what a failed episode becomes."""

    @field_validator("top_p")
    @classmethod
    def _untruncated(cls, top_p: float) -> float:
        if top_p < 1:
            raise ValueError(
                f"rollout.top_p={top_p} is refused: vLLM returns logprobs of the truncated (renormalised) distribution "
                "while the learner scores the full one, so pi_old / pi_behaviour is biased below 1 on every sampled "
                "token (by the kept mass), and the off-policy correction (algorithm.off_policy) weights every token "
                "by that bias; set rollout.top_p=1 and lower rollout.temperature to sharpen sampling instead"
            )
        return top_p


class McpEnvironmentSection(Section):
    url: str | None = None
    """Streamable HTTP endpoint of the MCP tool server, e.g. http://127.0.0.1:8000/mcp (set this or `command`)."""
    command: list[str] | None = None
    """Launch a stdio MCP server, one process per episode: program and arguments, e.g. [uvx, mcp-server-time] (set this or `url`)."""
    env: dict[str, str] = {}
    """Environment variables for the `command` server, on top of the MCP SDK's default safe set (PATH, HOME, ...)."""
    cwd: str | None = None
    """Working directory of the `command` server (default: the reward server's)."""
    score: str | None = None
    """`module:function(answer, metadata, messages)` giving the final answer's reward (a float, or a dict with `reward` and components); default: exact match with metadata.answer."""
    max_turns: int = Field(4, ge=1)
    """Model turns before the episode ends without an answer (reward 0)."""
    call_timeout_s: float = Field(10.0, gt=0)
    """Deadline of one MCP call (opening a session, tools/list, tools/call)."""

    @model_validator(mode="after")
    def _one_transport(self) -> McpEnvironmentSection:
        if (self.url is None) == (self.command is None):
            raise ValueError("set exactly one of `url` (a Streamable HTTP server) and `command` (a stdio server "
                             f"to launch), got url={self.url!r}, command={self.command!r}")
        if self.command is not None and not self.command:
            raise ValueError("`command` is empty; give the program and its arguments, e.g. [uvx, mcp-server-time]")
        if self.command is None and (self.env or self.cwd):
            raise ValueError("`env` and `cwd` apply to a launched stdio server; set `command`, or drop them")
        return self


class CodeEnvironmentSection(Section):
    tests_key: str = "tests"
    """Metadata key holding the item's tests: a list (or JSON string of a list) of assert strings and/or {input, output} objects."""
    cpu_s: int = Field(5, ge=1)
    """CPU seconds each process of a run may use (RLIMIT_CPU)."""
    wall_s: float = Field(10.0, gt=0)
    """Wall-clock seconds one item's whole run may take; past it every process of the run is killed."""
    test_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock seconds one test may take inside the run."""
    memory_mb: int = Field(1024, ge=64)
    """Address space of each process of a run, MiB (RLIMIT_AS)."""
    max_processes: int = Field(16, ge=2)
    """Processes a run may have at once (RLIMIT_NPROC of its own uid; a fork bomb stops here)."""
    file_size_mb: int = Field(16, ge=1)
    """Largest file a run may write, MiB (RLIMIT_FSIZE)."""
    work_mb: int = Field(64, ge=1)
    """Size of the run's throw-away working directory (a tmpfs), MiB."""
    max_output_bytes: int = Field(65536, ge=1024)
    """Output read back from a run (and from each stdin/stdout test), bytes; the rest is dropped."""
    python: str | None = None
    """Interpreter that runs programs (its installation is bound read-only into the sandbox); default: the reward server's base Python."""


class JudgeEnvironmentSection(Section):
    url: str
    """Base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 (`/chat/completions` is appended)."""
    model: str
    """Model name sent in each request."""
    rubric: str
    """Prompt to the judge, with the placeholders {prompt} (the item's user messages), {completion} and {reference} (metadata[reference_key])."""
    system: str | None = None
    """Optional system message sent before the rubric."""
    reference_key: str = "answer"
    """Metadata key that fills {reference}."""
    score_regex: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """Regex whose first group is the score in the judge's reply (the last match counts); no match is a per-item 'unparseable verdict' error."""
    min_score: float = 0.0
    """Lowest score the rubric asks for; maps to reward 0."""
    max_score: float = 10.0
    """Highest score the rubric asks for; maps to reward 1 (a score outside [min_score, max_score] is a per-item error)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the judge."""
    max_tokens: int = Field(256, ge=1)
    """Tokens the judge may write per verdict."""
    max_concurrency: int = Field(8, ge=1)
    """Requests in flight to the endpoint at once (over all batches)."""
    timeout_s: float = Field(10.0, gt=0)
    """Deadline of one request; timeout_s * (retries + 1) must fit in reward.env_timeout_s."""
    retries: int = Field(1, ge=0)
    """Retries of a request that failed to connect, timed out, or got 429/5xx (with backoff); 4xx is not retried."""
    api_key_env: str | None = None
    """Environment variable holding the API key (sent as a Bearer token); unset: no key."""

    @model_validator(mode="after")
    def _rubric_and_regex(self) -> JudgeEnvironmentSection:
        import re

        if "{completion}" not in self.rubric:
            raise ValueError("rubric must contain {completion} (and may use {prompt}, {reference})")
        try:
            groups = re.compile(self.score_regex).groups
        except re.error as err:
            raise ValueError(f"score_regex {self.score_regex!r} is not a regular expression: {err}") from None
        if groups < 1:
            raise ValueError(f"score_regex {self.score_regex!r} needs a group capturing the score, e.g. (\\d+)")
        if self.max_score <= self.min_score:
            raise ValueError(f"max_score={self.max_score} must be above min_score={self.min_score}")
        return self


class OpenEnvEnvironmentSection(Section):
    url: str
    """Base URL of the OpenEnv environment server, e.g. http://127.0.0.1:8000 (its WebSocket /ws is used)."""
    action_field: str = "message"
    """Action field the model's message text fills (e.g. `message`, `code`)."""
    action: str | None = None
    """`module:function(text, metadata) -> dict` building the action instead of `action_field`."""
    observation_field: str | None = None
    """Observation field shown to the model; default: the observation itself when its only field is text, else the observation as JSON."""
    reset_keys: list[str] = ["seed"]
    """Dataset metadata keys passed to the server's reset as keyword arguments when present."""
    max_turns: int = Field(8, ge=1)
    """Model turns before the episode ends (the server's done ends it sooner)."""
    call_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one call to the server (connect + reset, one step)."""


class MathEnvironmentSection(Section):
    timeout_s: float = Field(5.0, gt=0)
    """Longest one answer's math-verify check may take; past it its worker process is killed and replaced, and the item scores 0 with a `timeout` component."""
    num_workers: int = Field(2, ge=1)
    """Verification processes (started on the first item scored)."""
    format_weight: float = Field(0.0, ge=0)
    """Reward added when the answer is in the expected form (boxed, or after `####`); 0: reward is correctness alone."""


class RewardSection(Section):
    functions: dict[str, str] = {}
    """Extra single-turn environments: name -> `module:function(prompt, completion, metadata)`."""
    remote: dict[str, str] = {}
    """Remote environment servers to proxy: name -> host:port."""
    score_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one batched Score call."""
    env_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one local environment call (a Score batch or item, a reset, a step); past it the item fails or the step returns DEADLINE_EXCEEDED."""
    env_max_concurrency: int = Field(8, ge=1)
    """Calls one local environment runs at once; hung calls use up only these slots."""
    function_workers: int = Field(2, ge=1)
    """Worker processes per user reward function (`functions`); a call that misses env_timeout_s kills its worker, which is replaced."""
    function_memory_mb: int = Field(4096, ge=64)
    """Address-space limit of each reward-function worker (RLIMIT_AS, MiB); past it the item fails and the worker is replaced."""
    function_cpu_s: float = Field(60.0, gt=0)
    """CPU seconds one reward-function call may use (RLIMIT_CPU); past it the kernel kills the worker, which is replaced."""
    function_env: list[str] = []
    """Environment variables passed to reward-function workers by name; they get no other (no token or credentials)."""
    max_abs_reward: float = Field(1e4, gt=0)
    """Largest |reward| (and |reward component|) accepted: beyond it, or not finite, the rollout server fails the sample and the learner drops the group."""
    session_idle_timeout_s: float = Field(600.0, gt=0)
    """Multi-turn sessions idle this long are closed."""
    replica_id: str | None = None
    """Names this reward-server replica in session ids (e.g. the pod name); random per start when unset."""
    mcp: dict[str, McpEnvironmentSection] = {}
    """MCP tool servers served as multi-turn tool-use environments: name -> url, scoring function, budgets."""
    openenv: dict[str, OpenEnvEnvironmentSection] = {}
    """OpenEnv environment servers served as multi-turn environments: name -> url, action/observation mapping, budgets."""
    code: dict[str, CodeEnvironmentSection] = {}
    """Code environments: name -> sandbox limits; the model's Python is run against metadata tests, reward = pass rate."""
    judge: dict[str, JudgeEnvironmentSection] = {}
    """LLM-judge environments: name -> OpenAI-compatible endpoint, model, rubric, score parsing, concurrency, timeouts."""
    allow_register: bool = False
    """Accept `RegisterEnvironment` calls (environments added at run time by any authenticated caller); off: only the configured environments are served."""
    max_score_items: int = Field(4096, ge=1)
    """Items one Score call may carry; more is INVALID_ARGUMENT."""
    max_text_chars: int = Field(262144, ge=1)
    """Characters a prompt (all its messages), a completion or a step's action may hold; more is INVALID_ARGUMENT."""
    max_metadata_bytes: int = Field(65536, ge=1)
    """Serialized size of one item's env_metadata; more is INVALID_ARGUMENT."""
    max_sessions: int = Field(8192, ge=1)
    """Multi-turn sessions open on one reward server; a Reset past it is RESOURCE_EXHAUSTED."""
    max_sessions_per_client: int = Field(2048, ge=1)
    """Sessions one caller (one host; with its tier under mutual TLS) may hold open; a Reset past it is RESOURCE_EXHAUSTED. A rollout server holds up to rollout.max_concurrent_groups * n at once, and every caller on one host (or behind a proxying reward server) counts as one."""
    math: MathEnvironmentSection = MathEnvironmentSection()
    """The built-in `math` environment (final answers checked with math-verify): its per-item timeout, worker processes and format reward."""
    env_processes: list[str] = []
    """Environments `rlmesh up` serves from a reward-server process of their own (own crash domain and CPU), proxied by the main reward server under the same name like any remote environment."""

    @model_validator(mode="after")
    def _env_budgets_fit(self) -> RewardSection:
        for name, code in self.code.items():
            if code.wall_s >= self.env_timeout_s:
                raise ValueError(f"code.{name}.wall_s={code.wall_s} must be below env_timeout_s={self.env_timeout_s} "
                                 "(the run must end before the reward server gives up on the item)")
        for name, judge in self.judge.items():
            budget = judge.timeout_s * (judge.retries + 1)
            if budget > self.env_timeout_s:
                raise ValueError(f"judge.{name}: timeout_s * (retries + 1) = {budget:g}s exceeds env_timeout_s="
                                 f"{self.env_timeout_s}; lower timeout_s or retries, or raise env_timeout_s")
        return self


class LoRASection(Section):
    rank: Literal[0, 1, 8, 16, 32, 64, 128, 256] = 0
    """LoRA rank r (0: off, full fine-tuning); the ranks vLLM can serve (its max_lora_rank choices)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training (0 keeps the learner's logprobs equal to vLLM's)."""
    target_modules: list[str] | str = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Module names (suffixes) that get an adapter, or "all-linear"; passed to peft's LoraConfig."""


class FSDP2BackendSection(Section):
    type: Literal["fsdp2"] = "fsdp2"
    """PyTorch FSDP2 (`fully_shard`) over an HF model; gloo on CPU, NCCL on GPU."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the sharded parameters."""


class MegatronBackendSection(Section):
    type: Literal["megatron"] = "megatron"
    """Megatron-core GPTModel (HF Qwen2/Llama converted in and out), its DDP and distributed optimizer."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (splits attention heads, MLP and vocabulary over ranks)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size (splits the layers into stages); data parallel = num_ranks / (tensor * pipeline)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype (bfloat16 keeps float32 master weights in the optimizer)."""


BackendSection = Annotated[
    Union[FSDP2BackendSection, MegatronBackendSection], Field(discriminator="type")
]


class LearnerSection(Section):
    backend: BackendSection = FSDP2BackendSection()
    """Training backend, chosen by `type` (fsdp2, megatron)."""
    num_ranks: int = Field(1, ge=1)
    """Training processes; above 1, `rlmesh up` launches the learner under torchrun (rank 0 is the controller)."""
    max_restarts: int = Field(3, ge=0)
    """Times torchrun restarts the whole learner job after a rank dies (it resumes from the newest checkpoint)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate (peak)."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """constant, or linear decay from `lr` to `lr * lr_final_ratio` over `num_steps`."""
    lr_final_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of `lr` (linear schedule)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""
    num_steps: int = Field(40, ge=1)
    """Optimizer steps of RL (each bumps the policy version)."""
    groups_per_step: int = Field(16, ge=1)
    """Prompt groups consumed per optimizer step."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Build micro-batches by a padded-token budget (rows x longest row) over length-sorted sequences instead of micro_batch_size sequences in order: long-tail batches pad far less; the step's loss and update are the same (0: off)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on held-out prompts every N steps (0: only before and after)."""
    eval_overlap: bool = True
    """Mid-run evaluations run beside training: the learner issues the eval prompts and goes on, and
    the record is written when the last answer is back (`generated_at_versions` says which weights
    answered; newer than `version` if a weight update reached the rollout tier first). false: the
    learner waits for each evaluation, and every answer comes from exactly `version`. The first and
    last evaluations always wait."""
    eval_pass_k: list[int] = []
    """Also report pass@k for these k (e.g. [1, 4, 8]), per environment: every held-out prompt gets `eval_num_samples` completions sampled at rollout.temperature beside its greedy one (empty: greedy accuracy only)."""
    eval_num_samples: int | None = Field(None, ge=1)
    """Completions sampled per held-out prompt for pass@k (unset: the largest k); must be at least every k."""

    @model_validator(mode="after")
    def _pass_k_fits(self) -> LearnerSection:
        n = self.eval_num_samples or max(self.eval_pass_k, default=1)
        bad = [k for k in self.eval_pass_k if not 1 <= k <= n]
        if bad:
            raise ValueError(f"learner.eval_pass_k={self.eval_pass_k}: every k must be in [1, eval_num_samples={n}] "
                             f"(got {bad}); raise learner.eval_num_samples or drop those k")
        return self
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads of the learner process."""
    cpu_cores: str = Field("auto", pattern=r"^(auto|\d+(-\d+)?(,\d+(-\d+)?)*)$")
    """Cores the learner's processes are pinned to, e.g. '1' or '1-3,6' ('auto': not pinned). On a small machine, give vLLM (rollout.cpu_cores) and the learner different cores so generation and training overlap instead of sharing cores."""

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _core_list_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, int) else value  # `learner.cpu_cores=1` parses as YAML int
    min_generators: int = Field(1, ge=1)
    """Rollout servers that must have registered before the learner issues work."""
    lora: LoRASection = LoRASection()
    """LoRA (peft) on the FSDP2 backend: only the adapter trains, and each weight update ships only the adapter."""


class SFTSection(Section):
    num_steps: int = Field(0, ge=0)
    """Supervised warm-start steps before RL (0: none)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per SFT step."""
    lr: float = Field(3e-3, gt=0)
    """SFT learning rate."""
    label_noise: float = Field(0.0, ge=0, le=1)
    """Fraction of SFT targets made wrong so the warm start leaves room for RL: a single answer is replaced by the example's `rejected` answer where it has one (data.rejected_key), else gets a stray trailing "!"; a multi-turn demonstration is replaced by its example's shortcut (the calculator's: answer at once without the tool, repeating the first number)."""


class DPOSection(Section):
    num_steps: int = Field(0, ge=0)
    """Optimizer steps of `rlmesh dpo` (0: none; `rlmesh dpo` asks for a positive number)."""
    batch_size: int = Field(32, ge=1)
    """Preference pairs per step."""
    lr: float = Field(1e-4, gt=0)
    """DPO learning rate (constant)."""
    beta: float = Field(0.1, gt=0)
    """Strength of the implicit KL to the reference policy (the starting model): the loss is -log sigmoid(beta * ((log pi - log ref)(chosen) - (log pi - log ref)(rejected)))."""
    sft_weight: float = Field(0.0, ge=0)
    """Adds this times the chosen responses' mean token NLL to the loss (RPO): keeps DPO from making the chosen answers themselves less likely while it widens the margin (0: plain DPO)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on the held-out pairs every N steps (0: only before and after)."""


class OffPolicySection(Section):
    mode: Literal["tis", "icepop", "seq_mask", "seq_tis"] = "tis"
    """Correction for pi_old / pi_behaviour (staleness, train/inference mismatch): `tis` token weight min(ratio, algorithm.tis_cap); `icepop` token weight = ratio inside [low, high], 0 outside; `seq_mask` sequence weight = the sequence's ratio inside [low, high], 0 (the sequence dropped) outside; `seq_tis` sequence weight min(sequence ratio, algorithm.tis_cap)."""
    low: float = Field(0.5, ge=0)
    """Lower edge of the ratio band of `icepop` and `seq_mask`."""
    high: float = Field(2.0, gt=0)
    """Upper edge of the ratio band of `icepop` and `seq_mask`."""
    seq_ratio: Literal["geometric_mean", "product"] = "geometric_mean"
    """A sequence's ratio for `seq_mask` / `seq_tis`: exp(mean token log-ratio), independent of length, or exp(sum), the product of token ratios (TRL's `sequence_*` modes)."""

    @model_validator(mode="after")
    def _band(self) -> "OffPolicySection":
        if self.low >= self.high:
            raise ValueError(f"algorithm.off_policy.low={self.low} must be below algorithm.off_policy.high={self.high}")
        return self


class KLSection(Section):
    coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference policy (the frozen starting model); 0: off, no reference model is built."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(pi || pi_ref) on sampled tokens, d = log pi - log pi_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d."""
    clamp: float = Field(10.0, gt=0)
    """Each token's estimate is clamped to [-clamp, clamp] (as verl's low_var_kl): on stale samples k3 grows like exp(-d) where the policy has since made a sampled token unlikely, and one such token would otherwise outweigh the step."""
    where: Literal["loss", "reward"] = "loss"
    """`loss`: coef * estimator(pi_theta, pi_ref) added to each token's loss (differentiated); `reward`: coef * the summed estimator of the sampled sequence under the behaviour policy subtracted from its reward before advantages."""


class AlgorithmSection(Section):
    name: Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"] = "grpo"
    """Policy-gradient family member (sets advantage and loss normalisation)."""
    group_size: int = Field(8, ge=2)
    """Completions per prompt (`n`)."""
    max_staleness: int = Field(1, ge=0)
    """k: 0 is synchronous on-policy; k >= 1 overlaps generation with training."""
    clip_low: float = Field(0.2, ge=0)
    """PPO ratio clip below 1."""
    clip_high: float = Field(0.2, ge=0)
    """PPO ratio clip above 1 (DAPO's clip-higher raises it)."""
    tis_cap: float = Field(2.0, ge=1)
    """Truncated importance sampling cap on pi_old / pi_behaviour (per token for off_policy.mode=tis, per sequence for seq_tis)."""
    drop_zero_advantage_groups: bool = False
    """Skip groups whose rewards are all equal (DAPO dynamic sampling)."""
    recompute_old_logprobs: bool = False
    """pi_old (the PPO ratio's denominator, the TIS weight's numerator) from a separate no-grad forward before the step (true), or from the training forward itself, detached (false): the same values while each batch gets exactly one optimizer step, as here, for one forward less per step. Set true for a model with dropout."""
    off_policy: OffPolicySection = OffPolicySection()
    """How the behaviour policy's (vLLM's) logprobs correct the loss."""
    kl: KLSection = KLSection()
    """KL penalty to a frozen copy of the starting policy."""


class QueueSection(Section):
    url: str = "embedded"
    """`embedded` starts a Valkey server for the run (with a random password); otherwise a redis:// or rediss:// (TLS) URL, best without a password in it (use password_file / password_env)."""
    username: str | None = None
    """ACL user the services log in as (`{tier}` becomes learner or rollout, for one ACL user per tier); unset: the default user."""
    password_file: str | None = None
    """File holding the queue password (`{tier}` becomes learner or rollout); takes precedence over password_env."""
    password_env: str = "RLMESH_QUEUE_PASSWORD"
    """Environment variable holding the queue password (unset: no password). Never written to config files."""
    tls_ca_file: str | None = None
    """CA certificate that verifies a rediss:// server (unset: the system's CAs)."""
    tls_cert_file: str | None = None
    """Client certificate for a rediss:// server that asks for one (`{tier}` allowed)."""
    tls_key_file: str | None = None
    """Key of tls_cert_file (`{tier}` allowed)."""
    prompt_stream: str = "rlmesh:prompts"
    """Stream of prompt groups (learner -> rollout)."""
    trajectory_stream: str = "rlmesh:trajectories"
    """Stream of trajectory groups (rollout -> learner)."""
    max_len: int = Field(10000, ge=1)
    """Unacked entries a stream may hold; producers wait beyond it (nothing is trimmed)."""
    claim_idle_ms: int = Field(60000, ge=100)
    """Entries pending this long on a dead consumer are claimed by another."""


class WeightSyncSection(Section):
    backend: Literal["gloo", "nccl"] = "gloo"
    """Broadcast transport: gloo (any host; every transfer digest-verified) or nccl (GPU learner and rollout servers, vLLM's NCCL engine; not yet run on a GPU)."""
    master_address: str = "127.0.0.1"
    """Address rollout servers dial to reach the learner's rendezvous store, and the only weight group they join: in containers the learner's host or Service name, never 0.0.0.0."""
    bind_address: str | None = None
    """Local interface the learner's rendezvous store listens on (unset: the one master_address resolves to); set it where master_address is not a local address, e.g. the pod IP behind a Service name."""
    store_port: int = Field(0, ge=0, le=65535)
    """Port of that store (0: any free port; fix it where a firewall or Service must name it)."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of one broadcast round (rendezvous included)."""
    control_concurrency: int = Field(64, ge=1)
    """Most per-step control calls (pause, start, finish, resume) the learner has in flight at once across rollout servers; the weight transfer itself always goes to all at once."""
    digest_algorithm: Literal["blake3", "sha256"] = "blake3"
    """Digest both sides take of every gloo transfer: blake3 (faster), or sha256; a group with a rollout server that predates blake3 uses sha256."""

    @model_validator(mode="after")
    def _dialable(self) -> "WeightSyncSection":
        if self.master_address in ("0.0.0.0", "::", ""):
            raise ValueError(f"weight_sync.master_address={self.master_address!r} is not an address rollout servers "
                             "can dial; give the learner's host name, IP or Service name (and weight_sync.bind_address "
                             "where that name is not a local interface)")
        return self


class TLSSection(Section):
    cert_file: str | None = None
    """PEM certificate this service presents, as a server and as a client (`{tier}` becomes learner, rollout or reward; `rlmesh tls-init` makes them); RLMESH_TLS_CERT overrides it."""
    key_file: str | None = None
    """PEM key of cert_file (`{tier}` allowed); RLMESH_TLS_KEY overrides it."""
    ca_file: str | None = None
    """PEM CA that signed every tier's certificate; RLMESH_TLS_CA overrides it. Set with cert_file: mutual TLS (servers refuse clients without a certificate from this CA, and the certificate's CN is the caller's tier)."""
    server_name_is_tier: bool = True
    """Clients check a server's certificate against its tier name (a DNS name `learner`, `rollout`, `reward` in the certificate) rather than the host dialled, so one certificate per tier serves any pod IP; false: against the host dialled."""


class LimitsSection(Section):
    learner_max_message_mib: int = Field(4, ge=1)
    """Largest request or response the learner's control-plane server accepts (MiB)."""
    rollout_max_message_mib: int = Field(32, ge=1)
    """Largest request or response a rollout server accepts (MiB): weight-update metadata lists every tensor's name and shape."""
    reward_max_message_mib: int = Field(64, ge=1)
    """Largest request or response a reward server accepts (MiB): a Score batch carries prompts and completions."""
    max_concurrent_rpcs: int = Field(4096, ge=1)
    """Calls one server runs at once; past it a call is refused with RESOURCE_EXHAUSTED."""
    max_metadata_kib: int = Field(16, ge=1)
    """Largest header metadata a server accepts per call (KiB)."""


class NetworkSection(Section):
    host: str = "127.0.0.1"
    """Interface services bind to. Anything but a loopback address needs a token (or mutual TLS), or `insecure: true`."""
    insecure: bool = False
    """Serve without a token on a non-loopback address (a trusted lab network only): anyone who reaches a port may then call it."""
    tls: TLSSection = TLSSection()
    """TLS on every gRPC channel, mutual when ca_file and cert_file are both set."""
    limits: LimitsSection = LimitsSection()
    """Bounds every gRPC server enforces."""
    learner_address: str = "127.0.0.1:50051"
    """Learner control plane."""
    reward_address: str = "127.0.0.1:50052"
    """Reward server, or several replicas comma-separated (`a:50052,b:50052`): rollout servers spread Score calls and episodes over them."""
    token_env: str = "RLMESH_TOKEN"
    """Environment variable holding the shared bearer token (unset: no auth, allowed only on loopback or with `insecure`)."""
    token_file: str | None = None
    """File holding the shared bearer token (takes precedence over token_env)."""
    rpc_timeout_s: float = Field(30.0, gt=0)
    """Default deadline of a control-plane call."""


    @property
    def reward_addresses(self) -> list[str]:
        return [a.strip() for a in self.reward_address.split(",") if a.strip()]


class LoggingSection(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of every service."""
    progress: bool = True
    """Show a progress bar in `rlmesh up`."""
    format: Literal["text", "json"] = "text"
    """Log lines as text, or one JSON object per line (service, level, message, group id, version, trace id)."""
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl"]
    """Where the learner's step and eval metrics go; metrics.jsonl is always written (`pip install rlmesh[trackers]`)."""
    wandb_project: str = "rlmesh"
    """W&B project (offline unless WANDB_MODE=online; the run id is kept in the run directory)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (None: a file store in `<run_dir>/mlruns`)."""
    mlflow_experiment: str = "rlmesh"
    """MLflow experiment the run is logged under."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus /metrics port of every service, on network.host (0: any free port; ports written to `<run_dir>/metrics_ports/`; None: off)."""
    trace_file: bool = False
    """Also write every span as one JSON object per line to `<run_dir>/traces/<service>-<pid>.jsonl` (OTLP is used when OTEL_EXPORTER_OTLP_ENDPOINT is set)."""


class CheckpointSection(Section):
    every_n_steps: int = Field(0, ge=0)
    """Save every N steps (0: only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    hf_model: bool = True
    """Also write an HF model directory (`model/`) into each checkpoint; off for big models (use `rlmesh export`)."""


class RunConfig(Section):
    run: RunSection = RunSection()
    """Run identity and outputs."""
    model: ModelSection = TinyModelSection()
    """Policy model."""
    data: DataSection = ArithmeticDataSection()
    """Prompt dataset."""
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
        if self.learner.lora.rank and self.learner.backend.type != "fsdp2":
            raise ValueError(
                f"learner.lora.rank={self.learner.lora.rank} needs the fsdp2 backend: LoRA through peft is not built "
                f"for learner.backend.type={self.learner.backend.type}; use learner.backend.type=fsdp2 or "
                "learner.lora.rank=0")
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
        elif "input" in e and e["type"] not in ("missing",):
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {where}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. learner.lr=1e-4)")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key segment")
    return path, yaml.safe_load(raw) if raw.strip() else ""


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
    loaded = yaml.safe_load(p.read_text())
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
