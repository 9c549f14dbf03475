"""TRL's side of the comparison (bench/trl_vs_rlmesh.py, bench/long_generation.py): `GRPOTrainer` on
the same task with rlmesh's settings mapped onto it, in a process of its own (`run_trl` launches this
file), and the reading of its finished run (`read_trl`).

    python bench/trl_side.py WARM OUT [--generation hf] [--max-s S] [--t-launch T] [--config C] [--set KEY=VALUE ...]

Needs the bench extra (`make bench-setup`: trl, accelerate, datasets)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.task import DEMO, EVERY, child_env, environment, score  # noqa: E402

if TYPE_CHECKING:
    from rlmesh.services.config import RunConfig


def lr_factor(step: int, config: RunConfig) -> float:
    """rlmesh's learning-rate schedule (rlmesh.learner.train.schedule.learning_rate) as a multiplier at `step`."""
    cfg = config.learner
    if cfg.lr_schedule == "constant":
        return 1.0
    return 1 - (1 - cfg.lr_final_ratio) * min(step / max(cfg.num_steps - 1, 1), 1.0)


def run_trl(work: Path, warm: Path, generation: str, max_s: float, config_path: Path = DEMO,
            config_overrides: list[str] = ()) -> dict[str, Any]:
    """TRL's GRPOTrainer on `config_path` (with `config_overrides`, e.g. run.seed=1) in a process of its own."""
    out = work / "trl"
    out.mkdir(parents=True, exist_ok=True)
    t_launch = time.time()
    with open(work / "trl.log", "w") as log:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), str(warm), str(out),
                        "--generation", generation, "--max-s", str(max_s), "--t-launch", repr(t_launch),
                        "--config", str(config_path), *(f"--set={o}" for o in config_overrides)],
                       check=True, cwd=REPO, env=child_env(), stdout=log, stderr=log)
    return {**read_trl(work, generation), "process_s": time.time() - t_launch}


def read_trl(work: Path, generation: str) -> dict[str, Any]:
    """A finished TRL run under work/trl (its times were written as seconds since its launch)."""
    out = work / "trl"
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    at = {s["step"]: s["t"] for s in steps}
    checkpoints = {int(p.name.removeprefix("step_")): p for p in sorted(out.glob("step_*"))}
    # meta.json is written as the run ends: a run killed before (e.g. by the kernel's OOM killer) has
    # its steps and checkpoints only.
    meta_file = out / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {
        "train_start_s": float("nan"), "excluded_s": float("nan"), "stopped_by_cap": False, "killed": True,
        "generation_s": steps[-1].get("generation_s", float("nan")), "completion_lengths": []}
    first_gen = steps[0].get("generation_s", float("nan"))
    first_step = {"total_s": at[min(at)], "parts": {"trainer built (model, tokenizer, data)": meta["train_start_s"],
                                                     "first groups generated": first_gen,
                                                     "first step trained": at[min(at)] - meta["train_start_s"] - first_gen}}
    loop_s = at[max(at)] - (0.0 if meta.get("killed") else meta["train_start_s"])
    tokens = sum(meta["completion_lengths"])
    # One process alternates: while it generates (and scores) nothing trains, and the reverse.
    gen = meta["generation_s"] / loop_s
    return {"first_step_start_s": meta["train_start_s"], "steps": len(steps), "first_step": first_step,
            "loop_s": loop_s, "time_at_step": at, "checkpoints": checkpoints,
            "generated_tokens": tokens, "tokens_per_s": tokens / loop_s, "completion_lengths": meta["completion_lengths"],
            "learner_idle_frac": min(gen, 1.0), "rollout_idle_frac": {"trl": max(0.0, 1 - gen)},
            "excluded_s": meta["excluded_s"], "generation": generation, "stopped_by_cap": meta["stopped_by_cap"],
            "killed_before_its_end": bool(meta.get("killed"))}


def trl_worker(warm: Path, out: Path, generation: str, max_s: float, t_launch: float, config_path: Path = DEMO,
               config_overrides: list[str] = ()) -> None:
    """One TRL GRPOTrainer run. Times are seconds since the parent launched this process, less the
    time spent writing checkpoints for the evaluator (TRL is not charged for them)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.config import load_config

    from rlmesh.services.precision import resolve_precision

    # bf16 where rlmesh computes in it (learner.backend.param_dtype=auto resolves on this machine as it
    # does under `rlmesh up`): TRL then trains float32 weights under bf16 autocast, as its bf16=True does.
    config = resolve_precision(load_config(config_path, list(config_overrides)))
    bf16 = config.learner.backend.param_dtype == "bfloat16"
    # rlmesh's loss normalisations and TRL's loss_type of the same name are the same sums (the sequence
    # mean of token means, the step's token mean, max_tokens a sequence); Dr. GRPO drops the std scaling.
    losses = {"grpo": "group", "dapo": "group", "dr_grpo": "none"}
    if config.algorithm.name not in losses:
        raise ValueError(f"algorithm.name={config.algorithm.name!r}: this comparison maps only rlmesh's "
                         f"{', '.join(losses)} onto TRL's loss_type of the same name")
    # Both cores for TRL's one process (rlmesh's learner gets one thread: vLLM holds the other core).
    torch.set_num_threads(os.cpu_count() or 1)
    train_set, _ = load_dataset(config.data, config.run.seed)
    b, g = config.learner.groups_per_step, config.algorithm.group_size
    every = config.checkpoint.every_n_steps or EVERY  # the rlmesh side's checkpoint interval
    # rlmesh issues train prompts in data order, cycling (rlmesh.learner.rl.issuer): give TRL that same sequence.
    order = [train_set.at(i) for i in range(config.learner.num_steps * b)]
    dataset = Dataset.from_list([{"prompt": ex.prompt_messages, "answer": str(ex.metadata["answer"])} for ex in order])
    env = environment(config)
    lengths: list[int] = []  # every sampled completion's token count, in order

    def exact_answer(prompts, completions, answer, completion_ids=None, **_) -> list[float]:
        lengths.extend(len(ids) for ids in completion_ids or [])
        return score(env, [c[-1]["content"] for c in completions], answer)[0]

    tokenizer = AutoTokenizer.from_pretrained(str(warm))
    model = AutoModelForCausalLM.from_pretrained(str(warm), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learner.lr, weight_decay=config.learner.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    extra: dict[str, Any] = {}
    if generation == "vllm-colocate":
        extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": config.rollout.max_model_len}
    elif generation == "hf-paged":
        extra = {"use_transformers_continuous_batching": True}
    args = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=bf16, fp16=False, gradient_checkpointing=False,
        seed=config.run.seed, shuffle_dataset=False, max_steps=config.learner.num_steps,
        per_device_train_batch_size=b * g, gradient_accumulation_steps=1, num_generations=g,
        max_completion_length=config.rollout.max_tokens, temperature=config.rollout.temperature,
        top_p=config.rollout.top_p, learning_rate=config.learner.lr, weight_decay=config.learner.weight_decay,
        max_grad_norm=config.learner.max_grad_norm, beta=0.0, num_iterations=1, loss_type=config.algorithm.name,
        scale_rewards=losses[config.algorithm.name], epsilon=config.algorithm.clip_low, epsilon_high=config.algorithm.clip_high,
        logging_steps=every, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        **extra)

    state = {"excluded": 0.0, "train_start": None, "stopped_by_cap": False, "generation": 0.0}
    steps_file = (out / "steps.jsonl").open("w")

    class Clock(TrainerCallback):
        def on_train_begin(self, args, st, control, **kw):
            state["train_start"] = time.time() - t_launch

        def on_step_end(self, args, st, control, model=None, **kw):
            t = time.time() - t_launch - state["excluded"]
            steps_file.write(json.dumps({"step": st.global_step, "t": t, "generation_s": state["generation"]}) + "\n")
            steps_file.flush()
            if st.global_step % every == 0:
                t0 = time.time()
                model.save_pretrained(str(out / f"step_{st.global_step:06d}"), safe_serialization=True)
                tokenizer.save_pretrained(str(out / f"step_{st.global_step:06d}"))  # vLLM loads it from there
                state["excluded"] += time.time() - t0
            if t > max_s and st.global_step % every == 0:
                state["stopped_by_cap"] = True
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=(optimizer, schedule), callbacks=[Clock()])
    generate = trainer._generate_and_score_completions  # the rollout phase of each step (sampling and scoring)

    def timed_generate(*a, **kw):
        t0 = time.time()
        try:
            return generate(*a, **kw)
        finally:
            state["generation"] += time.time() - t0

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    steps_file.close()
    (out / "meta.json").write_text(json.dumps({"train_start_s": state["train_start"], "excluded_s": state["excluded"],
                                               "stopped_by_cap": state["stopped_by_cap"],
                                               "generation_s": state["generation"], "completion_lengths": lengths}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("warm", type=Path, help="the model both sides start from (an HF directory with its tokenizer)")
    p.add_argument("out", type=Path, help="where the run writes steps.jsonl, meta.json and its checkpoints")
    p.add_argument("--generation", default="hf", choices=["hf", "hf-paged", "vllm-colocate"],
                   help="TRL's generation path (bench/trl_vs_rlmesh.py --trl-generation)")
    p.add_argument("--max-s", type=float, default=480.0, help="stop at the first checkpoint after this many seconds")
    p.add_argument("--t-launch", type=float, help="when the parent launched this process (time.time(); default: now)")
    p.add_argument("--config", type=Path, default=DEMO, help="the task's rlmesh config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trl_worker(args.warm, args.out, args.generation, args.max_s,
               args.t_launch if args.t_launch is not None else time.time(), args.config, args.set)


if __name__ == "__main__":
    main()
