"""Learner-step throughput against a plain PyTorch loop, side by side, on the same model and batch.

baseline: a plain loop over the HF model: per micro-batch forward/backward with the same GRPO loss
          (pi_old taken from that forward, as the learner does by default; with
          `--override algorithm.recompute_old_logprobs=true` both sides run a no-grad forward
          for it first), grad clipping, AdamW step.
measured: the learner's real step (`Trainer.step`: GRPO objective -> run_step -> FSDP2 backend),
          one rank, in this process.
scaling:  the same learner step under torchrun with 2 gloo ranks vs 1 rank (step time ratio).
megatron: the same learner step on the Megatron-core backend (learner.backend.type=megatron), 1 rank
          and tensor-parallel over 2 gloo ranks, against FSDP2 on the same ranks.
long tail (--long-tail, instead of the rows above): completions of 16..1,024 tokens (log-uniform),
          the learner step with count-based padded micro-batches vs token-budget micro-batches
          (learner.max_tokens_per_micro_batch), 1 rank each, and the ratio (target >= 1.5).
real model (--model DIR, e.g. models/smollm2-135m-instruct; --dtype float32|bfloat16): the plain
          loop and the learner's step, 1 rank, on that model (bfloat16: FSDP2's bf16 compute with
          float32 master weights vs autocast in the plain loop), each in a process of its own, one timed
          step of each in turn with the order swapped every round (--steps rounds), and each one's training FLOP/s
          (6 x parameters x tokens) as a fraction of this CPU's measured matmul peak on one thread
          in that dtype (MFU); with --shared-prompt-row-tokens N, also the learner's step with each
          prompt once per row (learner.shared_prompt_row_tokens=N) and its ratio to the step above.
Prints training tokens/s (prompt + completion tokens through forward/backward) of each and the
ratios. Run: python bench/learner_throughput.py [--hidden 256 --layers 4 --groups 16]
Real model, the demo's batch shape: python bench/learner_throughput.py --model models/smollm2-135m-instruct \
          --groups 4 --n 8 --prompt-len 64 --completion-len 160 --micro-batch-size 8 --steps 2"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_groups(num_groups: int, n: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0):
    from rlmesh.v1 import common_pb2

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        group = common_pb2.TrajectoryGroup(group_id=f"g{g}", prompt_token_ids=[rng.randrange(3, vocab)
                                                                               for _ in range(prompt_len)])
        for i in range(n):
            ids = [rng.randrange(3, vocab) for _ in range(rng.randint(completion_len // 2, completion_len))]
            group.samples.append(common_pb2.Sample(
                index=i, reward=float(i % 2), logprobs=[-rng.uniform(3, 7) for _ in ids],
                completion=common_pb2.TokenSequence(token_ids=ids, loss_mask=[True] * len(ids))))
        groups.append(group)
    return groups


def make_long_tail_groups(num_groups: int, n: int, prompt_len: int, vocab: int, seed: int = 0,
                          min_len: int = 16, max_len: int = 1024):
    """Like make_groups, with completion lengths log-uniform in [min_len, max_len]: most short, a few long."""
    import math

    groups = make_groups(num_groups, n, prompt_len, 2, vocab, seed)
    rng = random.Random(seed + 1)
    for group in groups:
        for sample in group.samples:
            num = int(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
            ids = [rng.randrange(3, vocab) for _ in range(num)]
            sample.completion.token_ids[:] = ids
            sample.completion.loss_mask[:] = [True] * num
            sample.logprobs[:] = [-rng.uniform(3, 7) for _ in ids]
    return groups


def config_for(model_dir: Path, micro_batch_size: int, overrides: list[str] | None = None, dtype: str = "float32"):
    from rlmesh.services.config import load_config

    return load_config(None, ["model.type=hf", f"model.path={model_dir}", f"learner.micro_batch_size={micro_batch_size}",
                              "learner.lr=1e-4", "rollout.max_tokens=64", "learner.torch_threads=1",
                              f"learner.backend.param_dtype={dtype}", *(overrides or [])])


def vocab_of(model_dir: Path) -> int:
    from transformers import AutoConfig

    return min(AutoConfig.from_pretrained(model_dir).vocab_size, 32000)


def matmul_peak_flops(dtype: str, size: int = 1024, seconds: float = 3.0) -> float:
    """This CPU's matmul FLOP/s on one thread in `dtype`: the best of repeated size x size products."""
    import torch

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    a, b = torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt)
    a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * size ** 3 / (time.perf_counter() - t0))
    return best


def num_tokens(seqs) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)


def time_learner(model_dir: Path, args) -> dict:
    """The learner's step; under torchrun every rank runs this and rank 0 reports."""
    from rlmesh.learner.train.trainer import Trainer

    trainer = Trainer(config_for(model_dir, args.micro_batch_size, args.override, args.dtype), str(model_dir), pad_id=0)
    if trainer.rank != 0:
        trainer.follow()
        return {}
    vocab = vocab_of(model_dir)
    groups = (make_long_tail_groups(args.groups, args.n, args.prompt_len, vocab) if args.long_tail else
              make_groups(args.groups, args.n, args.prompt_len, args.completion_len, vocab))
    seqs = trainer.objective.sequences(groups)
    trainer.step(seqs, 1e-4)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.step(seqs, 1e-4)
    elapsed = (time.perf_counter() - t0) / args.steps
    trainer.stop()
    return {"step_s": elapsed, "tokens_per_s": num_tokens(seqs) / elapsed, "world_size": trainer.world_size}


def plain_pytorch(model_dir: Path, args):
    """The plain loop's step as a function, and the sequences it trains on."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.train.batch import plan_step
    from rlmesh.learner.train.objectives.grpo import GRPOObjective

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = config_for(model_dir, args.micro_batch_size, args.override, args.dtype)
    objective = GRPOObjective.from_config(cfg)
    seqs = objective.sequences(make_groups(args.groups, args.n, args.prompt_len, args.completion_len, vocab_of(model_dir)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    bf16 = args.dtype == "bfloat16"  # float32 master weights, bf16 compute
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micros = plan_step(seqs, args.micro_batch_size, 0)

    def logprobs(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=m.input_ids_BT, attention_mask=m.attention_mask_BT).logits[:, :-1].float()
        return -torch.nn.functional.cross_entropy(logits.transpose(1, 2), m.input_ids_BT[:, 1:], reduction="none")

    def step():
        if objective.needs_old_logprobs:
            with torch.no_grad():
                for m in micros:
                    m.old_logprobs_BT = logprobs(m)
        opt.zero_grad(set_to_none=True)
        for m in micros:
            loss, _ = objective.loss(logprobs(m), m)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, seqs


def time_plain_pytorch(model_dir: Path, args) -> dict:
    step, seqs = plain_pytorch(model_dir, args)
    step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = (time.perf_counter() - t0) / args.steps
    return {"step_s": elapsed, "tokens_per_s": num_tokens(seqs) / elapsed}


def step_server(side: str, model_dir: Path, args) -> None:
    """One side of `interleaved` in a process of its own: load, warm up, then one timed step for each
    line read from stdin, its seconds written back as a line; the training tokens of a step first."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr; stdout carries only the replies
    if side == "plain":
        step, seqs = plain_pytorch(model_dir, args)
        trainer = None
    else:
        from rlmesh.learner.train.trainer import Trainer

        # A world of one in this process: the same backend and step a 1-rank torchrun job runs.
        trainer = Trainer(config_for(model_dir, args.micro_batch_size, args.override, args.dtype), str(model_dir), pad_id=0)
        seqs = trainer.objective.sequences(make_groups(args.groups, args.n, args.prompt_len, args.completion_len,
                                                       vocab_of(model_dir)))
        step = lambda: trainer.step(seqs, 1e-4)  # noqa: E731
    step()  # warm-up
    out.write(f"{num_tokens(seqs)}\n")
    for _ in sys.stdin:
        t0 = time.perf_counter()
        step()
        out.write(f"{time.perf_counter() - t0}\n")
    if trainer is not None:
        trainer.stop()


def interleaved(model_dir: Path, args) -> tuple[dict, dict]:
    """The plain loop and the learner's step, each in a process of its own, one timed step of each in
    turn with the order swapped every round (ABBA), so a drift in the machine's speed over the run
    falls on both sides alike; only one side computes at a time."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    names = ("plain", "learner_1rank")
    procs = {name: subprocess.Popen([sys.executable, __file__, "--step-server", name, str(model_dir), *sys.argv[1:]],
                                    cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name in names}
    try:
        tokens = {}
        for name in names:  # both loaded and warmed up (one after the other: one computes at a time)
            line = procs[name].stdout.readline()
            if not line:
                raise SystemExit(f"the {name} side failed while loading (its output is above)")
            tokens[name] = int(line)
        assert tokens["plain"] == tokens["learner_1rank"], "both sides must train the same tokens"
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.steps):
            for name in (names if i % 2 == 0 else names[::-1]):
                procs[name].stdin.write("step\n")
                procs[name].stdin.flush()
                line = procs[name].stdout.readline()
                if not line:
                    raise SystemExit(f"the {name} side failed in step {i + 1} (its output is above)")
                times[name].append(float(line))
                print(f"step {i + 1}/{args.steps} {name}: {times[name][-1]:.1f} s", flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()
        for proc in procs.values():
            proc.wait(timeout=120)
    results = []
    for name in names:
        step_s = sum(times[name]) / len(times[name])
        results.append({"step_s": step_s, "tokens_per_s": tokens[name] / step_s, "steps_s": times[name]})
    results[1]["world_size"] = 1
    return results[0], results[1]


def torchrun_learner(model_dir: Path, nproc: int, args, tmp: Path, overrides: tuple[str, ...] = ()) -> dict:
    out = tmp / f"learner_{nproc}_{len(overrides)}.json"
    # The worker's arguments travel in the environment: torchrun's own parser would take an option such
    # as --n for an abbreviation of one of its own (--nnodes...) and refuse it as ambiguous.
    worker_argv = ["--worker", str(model_dir), str(out), *sys.argv[1:], *(f"--override={o}" for o in overrides)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__]
    log = tmp / f"learner_{nproc}_{len(overrides)}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "BENCH_WORKER_ARGV": json.dumps(worker_argv)}
    if subprocess.run(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT).returncode:
        raise SystemExit(f"the learner worker failed:\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="an HF model directory to run instead of the tiny random one (only the plain "
                                   "and 1-rank rows, with MFU)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="training compute dtype of both sides (learner.backend.param_dtype)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=3,
                   help="timed steps a side, after one warm-up step (with --model: rounds of one step of each side, "
                        "the order swapped every round; an even number puts each side first equally often)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-megatron", action="store_true", help="leave out the Megatron-core rows")
    p.add_argument("--long-tail", action="store_true",
                   help="only the long-tail comparison: padded vs token-budget micro-batches")
    p.add_argument("--max-tokens-per-micro-batch", type=int, default=4096, help="the budget of --long-tail")
    p.add_argument("--shared-prompt-row-tokens", type=int, default=0, metavar="N",
                   help="real model: also time the learner step with learner.shared_prompt_row_tokens=N")
    p.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--step-server", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="an rlmesh config override for both sides, e.g. algorithm.recompute_old_logprobs=true")
    return p.parse_known_args(argv)[0]


def main() -> None:
    args = parse(json.loads(os.environ["BENCH_WORKER_ARGV"]) if "BENCH_WORKER_ARGV" in os.environ else None)
    if args.step_server:
        step_server(args.step_server[0], Path(args.step_server[1]), args)
        return
    if args.worker:
        result = time_learner(Path(args.worker[0]), args)
        if result:
            Path(args.worker[1]).write_text(json.dumps(result))
        return
    if args.model:
        real_model(Path(args.model).resolve(), args)
        return
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        spec = TinyModelSection(hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                intermediate_size=args.hidden * 2)
        model_dir = write_tiny_model(spec, tmp / "model", seed=0)
        if args.long_tail:
            long_tail(model_dir, args, tmp)
            return
        plain = time_plain_pytorch(model_dir, args)
        one = torchrun_learner(model_dir, 1, args, tmp)
        two = torchrun_learner(model_dir, 2, args, tmp)
        megatron = {} if args.no_megatron else {
            "megatron_1rank": torchrun_learner(model_dir, 1, args, tmp, ("learner.backend.type=megatron",)),
            "megatron_tp2": torchrun_learner(model_dir, 2, args, tmp, ("learner.backend.type=megatron",
                                                                       "learner.backend.tensor_parallel=2"))}
    rows = [("plain PyTorch loop (1 process)", plain), ("rlmesh learner step, 1 rank", one),
            ("rlmesh learner step, 2 gloo ranks", two)]
    if megatron:
        rows += [("Megatron backend, 1 rank", megatron["megatron_1rank"]),
                 ("Megatron backend, TP=2 (2 gloo ranks)", megatron["megatron_tp2"])]
    print(f"model: hidden {args.hidden}, {args.layers} layers; batch {args.groups}x{args.n} sequences, "
          f"micro-batch {args.micro_batch_size}")
    print(f"{'path':38s} {'step s':>8s} {'train tok/s':>12s}")
    for name, r in rows:
        print(f"{name:38s} {r['step_s']:8.3f} {r['tokens_per_s']:12.0f}")
    ratio = one["tokens_per_s"] / plain["tokens_per_s"]
    scaling = two["step_s"] / one["step_s"]
    print(f"ratio (learner 1 rank / plain PyTorch tokens/s): {ratio:.2f}   (target >= 0.9)")
    print(f"2-rank / 1-rank step time: {scaling:.2f}   (on {os.cpu_count()} cores; < 1 means faster)")
    result = {"plain": plain, "learner_1rank": one, "learner_2rank": two, "ratio_vs_plain": ratio,
              "two_over_one_step_time": scaling}
    if megatron:
        result.update(megatron)
        result["megatron_1rank_over_fsdp2_tokens_per_s"] = megatron["megatron_1rank"]["tokens_per_s"] / one["tokens_per_s"]
        result["megatron_1rank_over_plain_tokens_per_s"] = megatron["megatron_1rank"]["tokens_per_s"] / plain["tokens_per_s"]
        result["megatron_tp2_over_fsdp2_2rank_step_time"] = megatron["megatron_tp2"]["step_s"] / two["step_s"]
        print(f"Megatron 1 rank / FSDP2 1 rank tokens/s: {result['megatron_1rank_over_fsdp2_tokens_per_s']:.2f}; "
              f"/ plain PyTorch: {result['megatron_1rank_over_plain_tokens_per_s']:.2f}")
        print(f"Megatron TP=2 / FSDP2 2 ranks step time: {result['megatron_tp2_over_fsdp2_2rank_step_time']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def real_model(model_dir: Path, args) -> None:
    """Plain loop and learner step (1 rank) on a real model, with each one's MFU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).parameters())
    peak = matmul_peak_flops(args.dtype)
    plain, one = interleaved(model_dir, args)
    with tempfile.TemporaryDirectory() as tmp_name:
        n = args.shared_prompt_row_tokens
        shared = torchrun_learner(model_dir, 1, args, Path(tmp_name), (f"learner.shared_prompt_row_tokens={n}",)) if n else None
    print(f"model: {model_dir.name} ({params / 1e6:.1f} M parameters), {args.dtype}; batch {args.groups}x{args.n} "
          f"sequences (prompt {args.prompt_len}, completions {args.completion_len // 2}..{args.completion_len}), "
          f"micro-batch {args.micro_batch_size}; one thread each")
    print(f"this CPU's {args.dtype} matmul peak, one thread: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'path':38s} {'step s':>8s} {'train tok/s':>12s} {'GFLOP/s':>9s} {'MFU':>6s}")
    result = {"model": str(model_dir), "dtype": args.dtype, "parameters": params, "peak_flops_1thread": peak}
    rows = [("plain", "plain PyTorch loop", plain), ("learner_1rank", "rlmesh learner step, 1 rank", one)]
    if shared:
        rows.append(("learner_shared_prompts", f"  the same, shared prompts (N={n})", shared))
    for key, name, r in rows:
        flops = 6 * params * r["tokens_per_s"]
        r.update(flops_per_s=flops, mfu=flops / peak)
        result[key] = r
        print(f"{name:38s} {r['step_s']:8.2f} {r['tokens_per_s']:12.0f} {flops / 1e9:9.1f} {r['mfu']:6.1%}")
    result["ratio_vs_plain"] = one["tokens_per_s"] / plain["tokens_per_s"]
    print(f"ratio (learner 1 rank / plain PyTorch tokens/s): {result['ratio_vs_plain']:.2f}   (target >= 0.9)")
    if shared:
        result["shared_prompts_over_learner"] = shared["tokens_per_s"] / one["tokens_per_s"]
        print(f"shared prompts / one row per sample, the learner's training tokens/s (the same tokens trained): "
              f"{result['shared_prompts_over_learner']:.2f} (its GFLOP/s and MFU count each prompt once per sample, "
              "as the other rows do: work saved, not done)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def long_tail(model_dir: Path, args, tmp: Path) -> None:
    budget = args.max_tokens_per_micro_batch
    padded = torchrun_learner(model_dir, 1, args, tmp)
    budgeted = torchrun_learner(model_dir, 1, args, tmp, (f"learner.max_tokens_per_micro_batch={budget}",))
    ratio = budgeted["tokens_per_s"] / padded["tokens_per_s"]
    print(f"model: hidden {args.hidden}, {args.layers} layers; long-tail batch {args.groups}x{args.n} sequences, "
          f"completions 16..1024 tokens, prompt {args.prompt_len}")
    print(f"{'path':52s} {'step s':>8s} {'train tok/s':>12s}")
    print(f"{f'padded: micro_batch_size={args.micro_batch_size}':52s} {padded['step_s']:8.3f} "
          f"{padded['tokens_per_s']:12.0f}")
    print(f"{f'token budget: max_tokens_per_micro_batch={budget}':52s} {budgeted['step_s']:8.3f} "
          f"{budgeted['tokens_per_s']:12.0f}")
    print(f"ratio (budgeted / padded tokens/s): {ratio:.2f}   (target >= 1.5)")
    if args.json:
        Path(args.json).write_text(json.dumps({"padded": padded, "budgeted": budgeted, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
