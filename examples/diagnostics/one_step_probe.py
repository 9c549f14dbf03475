"""How far one GRPO step moves a model: its greedy held-out accuracy after a single Adam step at each of
several learning rates, all taken along one gradient — in transformers alone, no mesh.

Adam's first step moves every weight by about the rate, in the sign of its gradient, so this is where
a model too sharp for a rate shows it first. Samples `--groups` training prompts `--group-size` times at
the run's temperature, scores each completion by its last number against the answer column (the math
environment's rule for one-number answers), computes the GRPO loss of those groups (group-normalised
advantages, token mean per sample) with `learner.freeze` applied, and for each rate applies
-rate * g / (|g| + 1e-8) to the starting weights — Adam's first update — and measures greedy accuracy
on the first `--eval` held-out prompts. Plain-text prompts (prompt.format: plain) only.

    python examples/diagnostics/one_step_probe.py -c examples/gemma3_base_grpo.yaml --lrs 1e-6 3e-6 1e-5
"""

from __future__ import annotations

import argparse
import re

import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.services.config import load_config


def last_number_matches(text: str, answer) -> float:
    numbers = re.findall(r"-?\d+", text.split("\n")[0])
    return float(bool(numbers) and numbers[-1] == str(answer))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    if cfg.prompt.format != "plain":
        raise SystemExit("one_step_probe: plain-text prompts only (prompt.format: plain)")
    torch.manual_seed(cfg.run.seed)
    data = cfg.data
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    temperature, max_tokens = cfg.rollout.temperature, cfg.rollout.max_tokens
    held_out = pd.read_parquet(data.eval_path).head(args.eval)
    train = pd.read_parquet(data.path).sample(args.groups, random_state=cfg.run.seed)

    def generate(rows, n: int, sample: bool):
        texts = [cfg.prompt.prefix + q + cfg.prompt.suffix for q in rows[data.prompt_key] for _ in range(n)]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=sample, top_p=1.0,
                                 temperature=temperature if sample else None)
        completions = out[:, enc["input_ids"].shape[1]:]
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        answers = [a for a in rows[data.answer_key] for _ in range(n)]
        return enc, completions, texts, [last_number_matches(t, a) for t, a in zip(texts, answers)]

    def greedy() -> tuple[float, str]:
        model.eval()
        _, _, texts, rewards = generate(held_out, 1, False)
        return sum(rewards) / len(rewards), texts[0].split("\n")[0]

    acc, example = greedy()
    print(f"starting weights: greedy {acc:.3f} on {len(held_out)} held-out prompts, e.g. {example!r}", flush=True)
    enc, completions, _, rewards = generate(train, args.group_size, True)
    r = torch.tensor(rewards).view(-1, args.group_size)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    print(f"{args.groups} groups sampled at T={temperature}: reward {r.mean():.3f}, "
          f"{int((r.std(1) > 0).sum())} with a signal", flush=True)
    # Each sample's own tokens: up to the first newline (the run's stop strings end the answer there).
    mask = torch.zeros(completions.shape)
    for i, row in enumerate(completions.tolist()):
        for j, token in enumerate(row):
            mask[i, j] = 1.0
            if token in (tok.eos_token_id, tok.pad_token_id) or "\n" in tok.decode([token]):
                break
    for name, p in model.named_parameters():
        if any(re.search(pattern, name) for pattern in cfg.learner.freeze):
            p.requires_grad_(False)
    model.train()
    ids = torch.cat([enc["input_ids"], completions], 1)
    attention = torch.cat([enc["attention_mask"], torch.ones_like(completions)], 1)
    start = enc["input_ids"].shape[1]
    for s in range(0, ids.shape[0], args.group_size):
        part = slice(s, s + args.group_size)
        logits = model(input_ids=ids[part], attention_mask=attention[part]).logits[:, start - 1:-1] / temperature
        logp = torch.log_softmax(logits.float(), -1).gather(-1, completions[part].unsqueeze(-1)).squeeze(-1)
        m = mask[part]
        (-((adv[part].unsqueeze(1) * logp * m).sum(1) / m.sum(1)).sum() / ids.shape[0]).backward()
    start_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for lr in args.lrs:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start_weights[n])
                if p.grad is not None:
                    p.add_(-lr * p.grad / (p.grad.abs() + 1e-8))
        acc, example = greedy()
        print(f"one Adam step at lr {lr:g}: greedy {acc:.3f}, e.g. {example!r}", flush=True)


if __name__ == "__main__":
    main()
