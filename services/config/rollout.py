"""The rollout section of the run config: rollout servers (vLLM) and multi-turn episode budgets."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlmesh.services.config.base import RolloutCores, Section


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


class AgentEndpointSection(Section):
    """The OpenAI-compatible chat-completions endpoint a rollout server opens for each agent episode."""

    enabled: bool = False
    """Serve the endpoint (agent environments need it); off, no listener is opened."""
    host: str = "127.0.0.1"
    """Interface the endpoint listens on (0.0.0.0 where agents run on other hosts)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint (0: any free port)."""
    public_url: str | None = None
    """Base URL agents are given (e.g. http://rollout-0:8100/v1); unset: http://<host>:<port>/v1 (https:// under network.tls, with the rollout tier's certificate)."""
    max_calls: int = Field(16, ge=1)
    """Chat-completion calls one episode may make; past it a call is refused (`episode_limit`)."""
    max_total_tokens: int | None = Field(None, ge=2)
    """Context of one episode (prompt, every call's tokens, every appended message); unset: rollout.max_model_len."""
    max_tokens: int | None = Field(None, ge=1)
    """Cap on one call's completion, at most rollout.max_tokens (every generation's cap); an agent's max_tokens lowers it; unset: rollout.max_tokens."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Life of an episode's key from its opening; past it calls are refused and the episode ends with `episode_timeout`."""
    max_request_bytes: int = Field(1 << 20, ge=1024)
    """Largest request body accepted (HTTP 413 past it)."""
    max_messages: int = Field(256, ge=1)
    """Messages one request may carry."""


class RolloutSection(Section):
    num_servers: int = Field(1, ge=1)
    """Rollout servers `rlmesh up` starts."""
    max_concurrent_groups: int = Field(64, ge=1)
    """Prompt groups one server generates at once (vLLM batches them)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences vLLM decodes at once (its max_num_seqs; unset: vLLM's default, 128 on a CPU). Requests beyond it wait, and vLLM takes the waiting ones in the order their groups were claimed (priority scheduling), so a lower bound makes the oldest groups finish first instead of all together: the learner can train them while the rest generate, at some cost in tokens/s where the bound is below what the engine decodes best (docs/real-model.md, "Settings, and why")."""
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
    dtype: Literal["float32", "bfloat16", "float16", "auto", "learner"] = "float32"
    """vLLM weights dtype: learner serves in the learner's compute dtype (learner.backend.param_dtype, resolved where it is auto), so both sides compute with the same weights; auto is the checkpoint's own dtype."""
    enforce_eager: bool = True
    """Skip torch.compile / graphs (much faster start-up on CPU)."""
    enable_prefix_caching: bool = False
    """Reuse the KV of shared prompt prefixes (the n samples of a group, shared system prompts); the cache is reset at every weight update, so KV computed by old weights is never reused. On, a group's first sample is prefilled before the others start, so they reuse its prompt's KV (vLLM caches only full blocks: see block_size)."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per KV-cache block (vLLM's default where unset: 128 on CPU, 16 on GPU; CPU needs a multiple of 32). Prefix caching reuses full blocks only: a block smaller than the prompt lets a group's samples share it."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_cores: RolloutCores = "auto"
    """Cores vLLM's CPU worker binds its threads to (VLLM_CPU_OMP_THREADS_BIND), the whole server pinned to them: '0', '0-3', 'auto' (vLLM picks; nothing pinned) or 'nobind' (no binding, nothing pinned: the kernel places the threads). 'nobind' suits replicas sharing a host without a cpuset of their own (compose's `--scale rollout=N`), where 'auto' binds every replica to the same core. With 'auto' on two or more cores, the core vLLM keeps for its scheduler also receives weight updates while the worker loads them (it idles while an update has the engine paused)."""
    episode: EpisodeSection = EpisodeSection()
    """Multi-turn episodes (environments whose kind is multi_turn): budgets and what a failed episode becomes."""
    agent_endpoint: AgentEndpointSection = AgentEndpointSection()
    """The per-episode OpenAI-compatible endpoint for agents that own their loop (docs/agents.md)."""

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
