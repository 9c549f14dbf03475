"""The reward section of the run config: reward servers and the environments they host."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlmesh.services.config.base import Section


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


class VerifiersEnvironmentSection(Section):
    env_id: str
    """What `verifiers.load_environment` takes: the environment's id as its package installs it (e.g. `sophistry-bench-sprint`), or a module with a `load_environment`."""
    args: dict[str, Any] = {}
    """Keyword arguments of the environment's `load_environment`."""
    python: str | None = None
    """Interpreter of the environment's own virtualenv (`rlmesh venv --output DIR verifiers==0.3.1 PACKAGE`: DIR/bin/python); `rlmesh up` serves the environment from an environment server it starts with it. Unset: this interpreter hosts it (verifiers installed beside rlmesh)."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one call into the environment (scoring a batch, starting an episode, one step)."""


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
    agents: dict[str, str | list[str]] = {}
    """Agent environments: name -> `module:function(prompt, metadata)` returning the reward, or a command (a list: program and arguments) that reads the task as JSON on stdin and prints its reward last on stdout; the user's agent runs unchanged against its episode's OpenAI-compatible endpoint (OPENAI_BASE_URL / OPENAI_API_KEY) (docs/agents.md)."""
    agent_timeout_s: float = Field(300.0, gt=0)
    """Wall-clock limit of one agent episode's process; past it the process is killed and the episode ends `agent_timeout`."""
    agent_max_concurrency: int = Field(64, ge=1)
    """Episodes one agent environment runs at once (a function agent's each a process forked from its launcher, ~140 MiB resident here and most of it shared with the launcher; a command agent's each a process of its own); the rest wait for a slot, and the wait does not count toward agent_timeout_s. The policy serves an agent's conversations only as fast as they come: at 8 the rollout server's vLLM saw at most 8 sequences at once, and the agent demo's steps waited on generation."""
    score_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one batched Score call: the rollout server waits this long, and the reward server answers within it (plus up to 1 s of scheduling on a loaded host) whatever its environments do, failing each item still unscored at 90% of it with an error (a hung reward function's worker is killed then, and replaced)."""
    env_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one local environment call (a Score batch or item, a reset, a step); past it the item fails or the step returns DEADLINE_EXCEEDED."""
    env_max_concurrency: int = Field(8, ge=1)
    """Calls one local environment runs at once; hung calls use up only these slots (agent episodes: agent_max_concurrency)."""
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
    verifiers: dict[str, VerifiersEnvironmentSection] = {}
    """`verifiers` environments (Prime Intellect's Environments Hub, classic API), unchanged: name -> env_id, its arguments, the interpreter of its virtualenv (docs/environments.md)."""
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
    env_server_memory_mb: int = Field(8192, ge=256)
    """Address-space limit (RLIMIT_AS, MiB) of each environment server `rlmesh up` starts (`env_processes`, and `verifiers` environments with a `python` of their own); an allocation past it fails the call that made it (MemoryError), and the server goes on. Elsewhere: `rlmesh reward --memory-mb`."""
    env_server_env: list[str] = []
    """Environment variables passed by name to the environment servers `rlmesh up` starts (e.g. a judge's API key); they get no other secret: not the queue password, not the trackers' or the hub's tokens (only the mesh token they authenticate calls with)."""

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
