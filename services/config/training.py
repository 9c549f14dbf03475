"""The training sections of the run config: the learner and its backend, LoRA, SFT, DPO, the RL
algorithm and checkpointing."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from rlmesh.services.config.base import CoreList, Section


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
    param_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Compute dtype of the sharded parameters (master weights and optimizer state stay float32); auto: bfloat16 where this machine's bf16 matmul is >= 1.25x float32's (a GPU with bf16, a CPU with AMX or fast AVX512-BF16), else float32."""


class MegatronBackendSection(Section):
    type: Literal["megatron"] = "megatron"
    """Megatron-core GPTModel (HF Qwen2/Llama converted in and out), its DDP and distributed optimizer."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (splits attention heads, MLP and vocabulary over ranks)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size (splits the layers into stages); data parallel = num_ranks / (tensor * pipeline)."""
    param_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Parameter and compute dtype (bfloat16 keeps float32 master weights in the optimizer); auto: bfloat16 where this machine computes it >= 1.25x faster than float32, else float32."""


BackendSection = Annotated[
    Union[FSDP2BackendSection, MegatronBackendSection], Field(discriminator="type")
]


class StallSection(Section):
    max_failed_groups: int | None = Field(None, ge=1)
    """Prompt groups in a row that fail (the rollout server rejects the prompt, or every sample's reward errs) with none succeeding in between before the run stops with the error on the console (unset: 2 x learner.groups_per_step, at least 8)."""
    zero_signal_groups: int | None = Field(None, ge=1)
    """Groups in a row whose rewards are all equal (no advantage, so nothing to learn) before `on_zero_signal` acts (unset: 8 x learner.groups_per_step, at least 32); a console warning comes at a quarter of it."""
    on_zero_signal: Literal["stop", "warn"] = "stop"
    """stop: end the run with the numbers and what to try; warn: say so on the console and go on."""


class LearnerSection(Section):
    backend: BackendSection = FSDP2BackendSection()
    """Training backend, chosen by `type` (fsdp2, megatron)."""
    num_ranks: int = Field(1, ge=1)
    """Training processes; above 1, `rlmesh up` launches the learner under torchrun (rank 0 is the controller)."""
    max_restarts: int = Field(3, ge=0)
    """Times torchrun restarts the whole learner job after a rank dies (it resumes from the newest checkpoint)."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate (peak)."""
    lr_bfloat16: float | None = Field(None, gt=0)
    """The learning rate instead of `lr` when the learner computes in bfloat16 (backend.param_dtype bfloat16, or auto resolved to it): a bf16 weight moves only once its float32 master has moved half a bf16 step, so a run that tunes lr in float32 may need a larger one in bf16. Unset: lr either way."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """constant, or linear decay from `lr` to `lr * lr_final_ratio` over `num_steps`."""
    lr_final_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of `lr` (linear schedule)."""
    warmup_steps: int = Field(0, ge=0)
    """The first N optimizer steps ramp the rate linearly, lr/N, 2·lr/N, ... up to the schedule's (0: none). Adam's first steps move every weight by about the rate whatever its gradient's size; a model whose policy is sharp in the gradient's direction (Gemma 3 270M: docs/models.md) needs the ramp."""
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
    shared_prompt_row_tokens: int = Field(0, ge=0)
    """Train each prompt once per row instead of once per sample: a row holds a prompt and then as many of its completions as fit in this many tokens, each completion attending to the prompt and to itself only (a custom attention mask, positions restarting after the prompt), so the logprobs and the update are the same while a group of n samples costs one prompt's forward and backward instead of n. It pays where prompts are long beside the answers (a system prompt, a chat template, multi-turn context) and the answers short; the mask is dense over a row, so keep rows near a few samples' length. fsdp2 backend, Hugging Face models that take a 4D attention mask (0: off)."""
    train_on_arrival: bool = True
    """Train each step's groups as they are admitted (forward and backward per arrival, the gradient accumulated; the optimizer step once the step's groups_per_step are in), so the learner trains while the rollout tier still generates the rest, the first step included. The update equals training the whole batch at once (each part's loss is summed and the gradient divided by the whole step's normaliser before clipping); the step takes groups in the order they were admitted instead of oldest first. The fsdp2 backend; the megatron backend, and algorithm.kl.where=reward (the penalty reshapes advantages across the whole step), train the whole batch at once. false: always at once."""
    eval_every: int = Field(0, ge=0)
    """Evaluate on held-out prompts every N steps (0: only before and after)."""
    eval_at_start: bool = True
    """Evaluate the starting policy (version 0) before training, beside the first step's generation where eval_overlap; summary.json's held_out_accuracy_before is its accuracy. false: no evaluation at start (NeMo RL's val_at_start, verl's val_before_train), so the first step's groups have the rollout tier to themselves; the first evaluation is then at step eval_every (or the last), and held_out_accuracy_before is null."""
    eval_overlap: bool = True
    """Mid-run evaluations run beside training: the learner issues the eval prompts and goes on, and
    the record is written when the last answer is back (`generated_at_versions` says which weights
    answered; newer than `version` if a weight update reached the rollout tier first). false: the
    learner waits for each evaluation, and every answer comes from exactly `version`. The first
    evaluation also overlaps (its prompts go out once the first step's groups are all in, so those
    generate alone and it runs while the learner trains them; the first weight update waits for its
    last answer, so it always measures the starting weights); the last always waits."""
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
    cpu_cores: CoreList = "auto"
    """Cores the learner's processes are pinned to, e.g. '1' or '1-3,6' ('auto': not pinned). On a small machine, give vLLM (rollout.cpu_cores) and the learner different cores so generation and training overlap instead of sharing cores."""

    min_generators: int = Field(1, ge=1)
    """Rollout servers that must have registered before the learner issues work."""
    stall: StallSection = StallSection()
    """When a run that cannot progress stops, saying why: errors that repeat for every group, and groups with no reward signal."""
    reissue_malformed_after_s: float = Field(600.0, gt=0)
    """Seconds a train group whose copies so far all came back malformed waits for a well-formed one before it is issued again under a fresh id (the old id is retired: a late copy of it is dropped, never trained)."""
    lora: LoRASection = LoRASection()
    """LoRA (peft) on the FSDP2 backend: only the adapter trains, and each weight update ships only the adapter."""
    freeze: list[str] = []
    """Parameters that stay as loaded (fsdp2 backend): regular expressions searched in the Hugging Face parameter names, e.g. ["embed_tokens"] to keep a large-vocabulary model's embedding (and a tied output layer, the same matrix) fixed while the rest trains. A pattern that matches nothing is an error at start."""

    @model_validator(mode="after")
    def _freeze_fits(self) -> LearnerSection:
        for pattern in self.freeze:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"learner.freeze: {pattern!r} is not a regular expression ({err})") from err
        if self.freeze and self.lora.rank:
            raise ValueError("learner.freeze with learner.lora.rank > 0: LoRA already trains the adapter alone; "
                             "drop one of them")
        if self.freeze and self.backend.type != "fsdp2":
            raise ValueError(f"learner.freeze is built for the fsdp2 backend (learner.backend.type={self.backend.type}); "
                             "use learner.backend.type=fsdp2 or learner.freeze=[]")
        return self


class SFTSection(Section):
    num_steps: int = Field(0, ge=0)
    """Supervised warm-start steps before RL (0: none)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per SFT step."""
    lr: float = Field(3e-3, gt=0)
    """SFT learning rate (the peak rate under the cosine schedule)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """`constant`: sft.lr every step; `cosine`: linear warm-up from 0 over sft.warmup_steps, then cosine decay from sft.lr to sft.lr * sft.lr_final_ratio at the last step."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up under `cosine` (0: none)."""
    lr_final_ratio: float = Field(0.0, ge=0, le=1)
    """The cosine schedule's last rate, as a fraction of sft.lr."""
    torch_threads: int | None = Field(None, ge=0)
    """torch threads of the warm start: unset, learner.torch_threads; 0, one per core the learner may use (learner.cpu_cores, or every core). More threads pay when the warm start is long: in `rlmesh up` the rollout servers start vLLM beside it and then idle until it ends, so a short one is hidden behind vLLM's start anyway, and more threads there only slow that start (2 CPU cores: the tool-use demo's 400-step warm start, 0.57 s a step on one thread, ran 1.6x faster on two; the arithmetic demo's 300 short steps made its whole run 89 -> 111 s on two)."""
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


class CreditSection(Section):
    assign: Literal["episode", "turn", "turn_state"] = "episode"
    """How a multi-turn episode's rewards become its tokens' advantages: `episode`, one group-relative advantage for every sampled token of the episode; `turn`, each turn's tokens get the group-relative advantage of that turn's discounted return (its reward and what followed), compared with every turn of the group; `turn_state`, the episode's advantage plus `state_weight` times the advantage of the turn's return among the group's turns taken from the same context (GiGPO's step groups). Turn rewards are the environment's step rewards (docs/training.md)."""
    discount: float = Field(1.0, ge=0, le=1)
    """gamma of a turn's return r_t + gamma r_t+1 + ... (`turn`, `turn_state`)."""
    state_weight: float = Field(1.0, ge=0)
    """Weight of the same-state advantage added to the episode's (`turn_state`)."""


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
    credit: CreditSection = CreditSection()
    """Per-episode or per-turn credit for multi-turn episodes."""

    @model_validator(mode="after")
    def _credit_with_kl(self) -> "AlgorithmSection":
        if self.credit.assign != "episode" and self.kl.coef > 0 and self.kl.where == "reward":
            raise ValueError(f"algorithm.credit.assign={self.credit.assign} takes the KL penalty in the loss only: "
                             "set algorithm.kl.where=loss (the reward penalty is per sequence, not per turn)")
        return self


class CheckpointSection(Section):
    every_n_steps: int = Field(0, ge=0)
    """Save every N steps (0: only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    hf_model: bool = True
    """Also write an HF model directory (`model/`) into each checkpoint; off for big models (use `rlmesh export`)."""
