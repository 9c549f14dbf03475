"""Rollout with long shared prompts: vLLM prefix caching on vs off, through the real rollout server.

Every group shares a long system prompt (>= 512 tokens) and samples n=8 completions of it, as RL
rollouts do. baseline: `rollout.enable_prefix_caching=false` (the prompt is prefilled once per
sample); measured: `true` (prefilled once, then reused; the cache is reset at every weight update so
old-weight KV is never reused — tested in tests/integration/test_rollout_server.py).
Run: python bench/prefix_caching.py [--groups 32 --prompt-tokens 600]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.rollout_throughput import mesh  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoTokenizer

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    tmp = Path(tempfile.mkdtemp(prefix="rlmesh-prefix-"))
    model_dir = write_tiny_model(TinyModelSection(), tmp / "model")
    # The tiny tokenizer is byte-level: one character, one token.
    system = ("You are a careful calculator. " * 40)[: args.prompt_tokens]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_len = len(tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "1+2="}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False))
    (tmp / "off").mkdir()
    (tmp / "on").mkdir()
    rollout = {"max_model_len": prompt_len + args.max_tokens + 64, "max_concurrent_groups": 64}
    off_tokens, off_s = asyncio.run(mesh(model_dir, args.groups, args.n, args.max_tokens, tmp / "off",
                                         {**rollout, "enable_prefix_caching": False}, system))
    on_tokens, on_s = asyncio.run(mesh(model_dir, args.groups, args.n, args.max_tokens, tmp / "on",
                                       {**rollout, "enable_prefix_caching": True}, system))
    # Throughput counts prompt + completion tokens processed per sample (what the GPU/CPU must serve).
    samples = args.groups * args.n
    off_rate, on_rate = samples / off_s, samples / on_s
    print(f"\nprompt {prompt_len} tokens shared by every group, n={args.n}, {args.groups} groups, "
          f"<= {args.max_tokens} completion tokens")
    print(f"{'path':34s} {'seconds':>8s} {'samples/s':>10s} {'gen tok/s':>10s}")
    print(f"{'prefix caching off':34s} {off_s:8.2f} {off_rate:10.1f} {off_tokens / off_s:10.0f}")
    print(f"{'prefix caching on (reset per update)':34s} {on_s:8.2f} {on_rate:10.1f} {on_tokens / on_s:10.0f}")
    print(f"gain (on / off samples/s): {on_rate / off_rate:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"off_s": off_s, "on_s": on_s, "gain": on_rate / off_rate,
                                               "prompt_tokens": prompt_len}, indent=2))


if __name__ == "__main__":
    main()
