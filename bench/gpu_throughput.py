"""The measurements of `bench/gpu_check.sh`: each part runs in a process of its own, so one that runs
out of memory or hangs leaves the others their GPU, and writes `OUT/parts/<part>.json`
(`bench/gpu_report.py` turns them into the results).

env       torch/CUDA/package versions, the device, and which optional GPU packages import.
link      the `rlmesh` package as pyproject's package-dir maps it, as symlinks in SITE (for a
          machine where the project is not pip-installed; PYTHONPATH=SITE makes `import rlmesh` work).
peak      bf16 matmul throughput (n x n x n, the card's practical bf16 peak; MFU's denominator).
model     a random-init model of the shape below, written as an HF directory (bf16 safetensors).
fsdp2     the learner's real step (`Trainer.step`: GRPO objective -> run_step -> FSDP2 backend with
          learner.backend.param_dtype=bfloat16; one rank: NCCL on CUDA, gloo on CPU).
plain     the same step as a plain PyTorch loop: the HF model in fp32 under bf16 autocast, the same
          GRPO loss computed on the device (the learner computes it on the CPU), grad clipping, AdamW;
          its micro-batches are packed and moved to the device once, outside the timing.
megatron  the learner's step on the Megatron-core backend (learner.backend.type=megatron, bf16).

Shape (default): Qwen2.5-1.5B's (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, vocab
151936, tied embeddings; 1.54 B parameters), 16 sequences of 2,048 tokens per step (8 groups of
2; 256 prompt + 1,792 completion tokens). `--cpu-smoke`: a tiny shape on CPU, to check the logic.
GPU_CHECK_SHAPE='{"micro_megatron": 2, "steps": 8}' (JSON) overrides fields of the shape.
Model FLOPs per token: 6 N (N: every parameter, the tied embedding counted once, as the LM head's
matmul) and, for the second MFU, + 12 L s d_attn (PaLM's attention term, s = sequence length,
no causal discount)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    prompt_len: int
    num_seqs: int
    group_size: int
    micro_fsdp2: int
    micro_plain: int
    # Megatron's local layer spec (no Transformer Engine) keeps each layer's [B, heads, T, T] softmax
    # (fp32) and probabilities for the backward, about 0.5 GiB a layer per 2,048-token row here: by
    # estimate ~50 GiB in all at 1 row, ~70 at 2, where FSDP2's flash attention is ~50 at 2.
    micro_megatron: int
    warmup: int
    steps: int
    matmul_n: int
    matmul_iters: int


SHAPES = {
    "gpu": Shape(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936, seq_len=2048,
                 prompt_len=256, num_seqs=16, group_size=2, micro_fsdp2=2, micro_plain=2, micro_megatron=1,
                 warmup=2, steps=5, matmul_n=8192, matmul_iters=100),
    "cpu-smoke": Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, seq_len=48,
                       prompt_len=16, num_seqs=4, group_size=2, micro_fsdp2=2, micro_plain=2, micro_megatron=1,
                       warmup=1, steps=2, matmul_n=256, matmul_iters=3),
}


def device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_memory_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# --- parts ------------------------------------------------------------------------------------------


def part_env(args, shape: Shape) -> dict:
    import importlib

    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "num_gpus": torch.cuda.device_count(), "modules": {}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", nccl=str(torch.cuda.nccl.version()))
    for name in ("transformers", "pydantic", "megatron.core", "yaml", "google.protobuf", "grpc", "vllm",
                 "transformer_engine", "apex", "flash_attn", "rlmesh", "rlmesh.learner.train.trainer"):
        try:
            module = importlib.import_module(name)
            out["modules"][name] = getattr(module, "__version__", "importable")
        except Exception as e:  # noqa: BLE001 -- the report says which optional package is missing and why
            out["modules"][name] = f"not importable: {type(e).__name__}: {e}"[:300]
    if "rlmesh" in sys.modules:
        out["rlmesh_from"] = str(Path(sys.modules["rlmesh"].__file__).parent)
    return out


def part_link(args, shape: Shape) -> dict:
    """SITE/rlmesh: a directory of symlinks that is the package tree pyproject's package-dir builds."""
    import shutil
    import tomllib

    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    site = Path(args.site)
    root = site / "rlmesh"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for entry in (REPO / dirs["rlmesh"]).iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for package, folder in dirs.items():
        if package == "rlmesh":
            continue
        parent, _, leaf = package.rpartition(".")
        assert parent == "rlmesh", f"package-dir {package!r}: only rlmesh.<name> mappings are linked"
        (root / leaf).symlink_to(REPO / folder)
    return {"site": str(site), "linked": sorted(dirs)}


def part_peak(args, shape: Shape) -> dict:
    import torch

    n, dev = shape.matmul_n, device()
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(max(shape.matmul_iters // 5, 1)):  # clocks up, cuBLAS heuristics cached
        a @ b
    best = math.inf
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(shape.matmul_iters):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - t0) / shape.matmul_iters)
    return {"n": n, "iters": shape.matmul_iters, "seconds_per_matmul": best, "flops_per_s": 2 * n**3 / best}


def hf_config(shape: Shape):
    import transformers

    return transformers.Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="bfloat16")


def part_model(args, shape: Shape) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with device():  # initialised on the device the check trains on, not on the CPU first
        model = transformers.Qwen2ForCausalLM(hf_config(shape))
    model.to(torch.bfloat16).save_pretrained(args.model_dir, safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())  # the tied embedding once
    return {"path": str(args.model_dir), "num_params": num_params, "seconds": time.perf_counter() - t0}


def make_sequences(shape: Shape, algorithm: str):
    """One step's batch as `GRPOObjective.sequences` makes it from trajectory groups (built here
    directly: the check then needs no generated protobuf code): `group_size` samples of a shared
    prompt, rewards 0, 1, 0, ... so every advantage is non-zero."""
    import torch

    from rlmesh.learner.train.algorithms.advantages import group_advantages
    from rlmesh.learner.train.batch import Sequence

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, shape.vocab, (shape.num_seqs, shape.seq_len), generator=gen)
    behaviour = -math.log(shape.vocab)  # a random-init model's logprob of any token
    seqs = []
    for g in range(shape.num_seqs // shape.group_size):
        rewards = torch.tensor([float(i % 2) for i in range(shape.group_size)])
        prompt = ids[g * shape.group_size, : shape.prompt_len].tolist()
        for i, adv in enumerate(group_advantages(rewards, algorithm).tolist()):
            completion = ids[g * shape.group_size + i, shape.prompt_len :].tolist()
            seqs.append(Sequence(prompt, completion, [True] * len(completion), [behaviour] * len(completion),
                                 adv, f"g{g}", float(rewards[i])))
    return seqs


def run_config(args, shape: Shape, backend: str, micro: int):
    from rlmesh.services.config import load_config

    return load_config(None, ["model.type=hf", f"model.path={args.model_dir}", f"learner.backend.type={backend}",
                              "learner.backend.param_dtype=bfloat16", f"learner.micro_batch_size={micro}",
                              "learner.lr=1e-5", f"rollout.max_tokens={shape.seq_len - shape.prompt_len}"])


def timed(step, shape: Shape) -> dict:
    """Median step time after `warmup` steps; each step printed as it ends (the log shows how far a
    part that timed out got)."""
    times, metrics = [], {}
    for i in range(shape.warmup + shape.steps):
        t0 = time.perf_counter()
        metrics = step()
        sync()
        seconds = time.perf_counter() - t0
        print(f"step {i} ({'warm-up' if i < shape.warmup else 'timed'}): {seconds:.3f} s, {metrics}", flush=True)
        if i >= shape.warmup:
            times.append(seconds)
    step_s = statistics.median(times)
    num_tokens = shape.num_seqs * shape.seq_len
    return {"step_s": step_s, "step_s_all": times, "tokens_per_step": num_tokens, "tokens_per_s": num_tokens / step_s,
            "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
            "finite": all(math.isfinite(metrics.get(k, 0.0)) for k in ("loss", "grad_norm")),
            "peak_memory_gib": peak_memory_gib()}


def learner_step(args, shape: Shape, backend: str, micro: int) -> dict:
    import torch.distributed as dist

    from rlmesh.learner.train.trainer import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(run_config(args, shape, backend, micro), str(args.model_dir), pad_id=0)
    load_s = time.perf_counter() - t0
    print(f"{backend} backend built in {load_s:.1f} s", flush=True)
    seqs = make_sequences(shape, trainer.config.algorithm.name)
    result = timed(lambda: trainer.step(seqs, 1e-5), shape)
    trainer.stop()
    out = {"backend": backend, "micro_batch_size": micro, "world_size": trainer.world_size,
           "process_group": dist.get_backend(), "load_s": load_s, **result}
    dist.destroy_process_group()
    return out


def part_fsdp2(args, shape: Shape) -> dict:
    return learner_step(args, shape, "fsdp2", shape.micro_fsdp2)


def part_megatron(args, shape: Shape) -> dict:
    from rlmesh.learner.train.backends.megatron import _have_te

    return {**learner_step(args, shape, "megatron", shape.micro_megatron), "transformer_engine": _have_te()}


def part_plain(args, shape: Shape) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.train.batch import plan_step
    from rlmesh.learner.train.objectives.grpo import GRPOObjective

    dev, micro = device(), shape.micro_plain
    torch.manual_seed(0)
    cfg = run_config(args, shape, "fsdp2", micro)
    objective = GRPOObjective.from_config(cfg)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(dev)
    load_s = time.perf_counter() - t0
    print(f"model loaded in {load_s:.1f} s", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=cfg.learner.weight_decay)
    micros = [dataclasses.replace(m, **{f.name: getattr(m, f.name).to(dev) for f in dataclasses.fields(m)
                                        if isinstance(getattr(m, f.name), torch.Tensor)})
              for m in plan_step(make_sequences(shape, cfg.algorithm.name), micro, 0)]

    def step() -> dict:
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for m in micros:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits_BTV = model(input_ids=m.input_ids_BT, attention_mask=m.attention_mask_BT).logits
            logits_BTV = logits_BTV[:, :-1].float() / objective.temperature
            logprobs_BT = -torch.nn.functional.cross_entropy(logits_BTV.transpose(1, 2), m.input_ids_BT[:, 1:],
                                                             reduction="none")
            loss, _ = objective.loss(logprobs_BT, m)
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.max_grad_norm)
        opt.step()
        return {"loss": loss_sum, "grad_norm": float(grad_norm)}

    return {"micro_batch_size": micro, "load_s": load_s, **timed(step, shape)}


PARTS = {"env": part_env, "link": part_link, "peak": part_peak, "model": part_model, "fsdp2": part_fsdp2,
         "plain": part_plain, "megatron": part_megatron}


def shape_for(mode: str) -> Shape:
    """The mode's shape with GPU_CHECK_SHAPE's overrides."""
    return dataclasses.replace(SHAPES[mode], **json.loads(os.environ.get("GPU_CHECK_SHAPE") or "{}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--out", default=str(REPO / "bench/results/gpu_check"), help="results folder (parts/ under it)")
    p.add_argument("--cpu-smoke", dest="mode", action="store_const", const="cpu-smoke", default="gpu",
                   help="a tiny shape on CPU: checks the logic, measures nothing of the GPU path")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/rlmesh_gpu_check/model"))
    p.add_argument("--site", default="/tmp/site", help="where `link` builds the rlmesh package tree")
    args = p.parse_args()
    if args.mode == "gpu" and args.part not in ("link", "env"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"gpu_throughput {args.part}: no CUDA device here; run with --cpu-smoke")
    result = PARTS[args.part](args, shape_for(args.mode))
    print(json.dumps(result, indent=2, default=str))
    if args.part != "link":
        parts = Path(args.out) / "parts"
        parts.mkdir(parents=True, exist_ok=True)
        (parts / f"{args.part}.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
