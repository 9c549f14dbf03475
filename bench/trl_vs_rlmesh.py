"""Time to reward, rlmesh vs TRL: the demo task (examples/arithmetic_grpo.yaml) trained from one
shared SFT warm start, once by `rlmesh up` (asynchronous GRPO, vLLM-CPU rollouts, the shipped demo
config) and once by TRL's `GRPOTrainer` with the same group size, prompts per step, prompt order,
learning rate and schedule, clip, sampling temperature, completion budget, reward function and chat
template. Wall time runs from launching each side's process to the step whose checkpoint first
reaches --target held-out accuracy; every checkpoint of both sides (the config's
checkpoint.every_n_steps, else every 10 steps) is scored after the runs by one evaluator
(`rlmesh eval`: vLLM greedy decoding in the dtype both sides computed in, the environment's own
`correct` signal; `--evaluator hf` for HF greedy instead). Neither side
evaluates while it trains (rlmesh's run evaluates once, after its last step: a cross-check of the
evaluator; `--in-loop-eval` keeps the config's evaluations). A config
without an SFT stage (sft.num_steps 0, e.g. the real-model demo examples/smollm2_grpo.yaml) starts
both sides from its own model directory instead.

The pieces take the config as a parameter (`--config`; the environment named by `data.env_name`
scores both sides): bench/long_generation.py runs them on the reasoning task.

Run: python bench/trl_vs_rlmesh.py [--config C] [--seed N] [--target 0.9] [--goal 3] [--trl-generation hf]
       [--trl-max-s 480] [--evaluator vllm|hf] [--in-loop-eval] [--json OUT] [--work DIR [--again]]
(seeds interleaved: one invocation per seed, each running rlmesh then TRL; `--again` reads and scores the
finished runs in --work DIR without launching anything)
Needs the bench extra (`make bench-setup`: trl, accelerate, datasets)."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.task import DEMO, EVERY, child_env, environment, score  # noqa: E402
from bench.trl_side import read_trl, run_trl  # noqa: E402

if TYPE_CHECKING:
    from rlmesh.learner.data.examples import Example
    from rlmesh.services.config import RunConfig


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
                       check=True, cwd=REPO, env=child_env(), stdout=log, stderr=log)
    return float(json.loads((out / "eval.json").read_text())["accuracy"])


# --- rlmesh side --------------------------------------------------------------------------------

def run_rlmesh(work: Path, warm: Path, overrides: list[str], config_path: Path = DEMO,
               name: str = "rlmesh", in_loop_eval: bool = False) -> dict[str, Any]:
    """`rlmesh up` on `config_path`, its model replaced by the shared warm start; files under work/name.
    Without `in_loop_eval` the run evaluates only after its last step (learner.eval_at_start false,
    learner.eval_every 0), as TRL's side evaluates nothing while it trains: the one evaluator scores
    both sides' checkpoints after the runs, and an evaluation of version 0 would otherwise take the
    rollout tier's core from the first steps' generation."""
    import yaml

    raw = yaml.safe_load(config_path.read_text())
    raw["model"] = {"type": "hf", "path": str(warm)}
    raw["sft"] = {**raw.get("sft", {}), "num_steps": 0}
    if not in_loop_eval:
        raw.setdefault("learner", {}).update(eval_at_start=False, eval_every=0)
    checkpoint = raw.setdefault("checkpoint", {})
    checkpoint.update(every_n_steps=checkpoint.get("every_n_steps") or EVERY, keep_last=1000)
    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    run_dir = work / name
    t_launch = time.time()  # the config's write time stands for it when a work directory is read again
    with open(work / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "rlmesh.cli", "up", "-c", str(cfg_path), "--run-dir", str(run_dir),
                        "logging.progress=false", *overrides], check=True, cwd=REPO, env=child_env(), stdout=log, stderr=log)
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
    # Launch to the first trained step (its optimizer step done: where TRL's clock stops too, at its
    # on_step_end), in three parts: the mesh up (Valkey, services, vLLM loaded and registered), waiting
    # for the first step's groups (training those in already, where the learner trains groups as they
    # arrive), and the training left once the last is in. Then, not counted: the wait for the first
    # evaluation's last answer and the weight send, until the step's record (a run without
    # `trained_time`, before it was recorded, counts up to the record).
    first_trained = train[0].get("trained_time", train[0]["time"]) - t_launch
    groups_in = first_trained - train[0]["train_s"]
    first_step = {"total_s": first_trained, "parts": {"mesh up, vLLM loaded": first_step_start,
                                                       "first groups generated": groups_in - first_step_start,
                                                       "first step trained": train[0]["train_s"]},
                  "trained_while_generating_s": max(0.0, training_s(train[0]) - train[0]["train_s"]),
                  "then_until_weights_out_s": at[min(at)] - first_trained}
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
        beside, after = f.get("trained_while_generating_s"), f.get("then_until_weights_out_s")
        print(f"{name}: launch -> first trained step {f['total_s']:.1f}s ("
              + ", ".join(f"{k} {v:.1f}s" for k, v in f["parts"].items())
              + (f"; {beside:.1f}s of training ran while the groups generated" if beside else "")
              + (f"; then {after:.1f}s to the weights out, the first evaluation's last answer awaited"
                 if after is not None else "") + ")")
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
    p.add_argument("--in-loop-eval", action="store_true",
                   help="keep the config's in-loop evaluations on rlmesh's side (default: only the one after the "
                        "last step, since TRL's side evaluates nothing while it trains)")
    p.add_argument("--work", help="working directory (default: a new temporary one)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--again", action="store_true",
                   help="launch nothing: read the finished runs in --work again and score them (e.g. after a "
                        "crash while reading or scoring them)")
    p.add_argument("overrides", nargs="*",
                   help="config overrides for both sides (e.g. algorithm.name=dapo: TRL's loss_type follows it); "
                        "those only rlmesh has, such as learner.torch_threads=2, leave TRL's side as it was")
    p.add_argument("--config", type=Path, default=DEMO, help="the task's rlmesh config (default: the arithmetic demo)")
    args = p.parse_args()

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
                       check=True, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        sides["rlmesh"] = run_rlmesh(work, warm, [*seeded, *args.overrides], args.config,
                                     in_loop_eval=args.in_loop_eval)
    if args.only != "rlmesh" and not args.again:
        print(f"TRL: GRPOTrainer, generation={args.trl_generation}", flush=True)
        sides["trl"] = run_trl(work, warm, args.trl_generation, args.trl_max_s, args.config,
                               [*seeded, *args.overrides])

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
