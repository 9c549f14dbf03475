"""Rollout-tier throughput against raw vLLM, side by side, on the same tiny model and prompts.

baseline: vLLM's AsyncLLM.generate called directly for G prompt groups x n samples.
measured: the same G groups through the real mesh path: prompt stream (Valkey) -> `rlmesh rollout`
          (vLLM + tokenisation + versions + logprobs) -> `rlmesh reward` (gRPC Score) ->
          trajectory stream.
Prints generated tokens/s of each and their ratio. Run: python bench/rollout_throughput.py"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))



async def raw_vllm(model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int) -> tuple[int, float]:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True,
                                                       max_model_len=256, enable_prefix_caching=False,
                                                       disable_log_stats=True))
    params = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(ids):
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
            final = out
        return len(final.outputs[0].token_ids)

    await asyncio.gather(*(one(p) for p in prompts[:8]))  # warm-up
    t0 = time.monotonic()
    counts = await asyncio.gather(*(one(p) for p in prompts for _ in range(n)))
    elapsed = time.monotonic() - t0
    engine.shutdown()
    return sum(counts), elapsed


async def mesh(model_dir: Path, num_groups: int, n: int, max_tokens: int, tmp: Path, rollout: dict | None = None,
               system: str | None = None) -> tuple[int, float]:
    """The mesh path; `rollout` overrides the rollout config, `system` prepends a shared system prompt."""
    from bench.harness import rollout_harness
    from rlmesh.v1 import common_pb2
    from rlmesh.services.queue import StreamQueue, connect

    rollout_cfg = {"max_tokens": max_tokens, "max_concurrent_groups": 256, "max_model_len": 256, **(rollout or {})}
    async with rollout_harness(model_dir, tmp, rollout=rollout_cfg, with_reward=True, rpc_timeout_s=60) as h:
        redis = connect(h.queue_url)
        prompts = StreamQueue(redis, "rlmesh:prompts", group="rollout")
        trajectories = StreamQueue(redis, "rlmesh:trajectories", group="learner")
        await trajectories.ensure_group()

        async def run_round(count: int) -> int:
            for i in range(count):
                g = common_pb2.PromptGroup(group_id=uuid.uuid4().hex, env_name="arithmetic", n=n,
                                           messages=[common_pb2.ChatMessage(role="user", content=f"{i % 10}+{i % 7}=")])
                if system:
                    g.messages.insert(0, common_pb2.ChatMessage(role="system", content=system))
                g.env_metadata.update({"answer": str(i % 10 + i % 7)})
                await prompts.publish(g.group_id, g.SerializeToString())
            tokens, got = 0, 0
            while got < count:
                for e in await trajectories.read("bench", count=256, block_ms=1000):
                    t = common_pb2.TrajectoryGroup.FromString(e.data)
                    tokens += sum(len(s.completion.token_ids) for s in t.samples)
                    got += 1
                    await trajectories.ack(e.id)
            return tokens

        await run_round(8)  # warm-up
        t0 = time.monotonic()
        tokens = await run_round(num_groups)
        return tokens, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64, help="prompt groups per measured round")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion length cap")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from transformers import AutoTokenizer

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    tmp = Path(tempfile.mkdtemp(prefix="rlmesh-bench-"))
    model_dir = write_tiny_model(TinyModelSection(), tmp / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{i % 10}+{i % 7}="}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for i in range(args.groups)]
    raw_tokens, raw_s = asyncio.run(raw_vllm(model_dir, prompts, args.n, args.max_tokens))
    mesh_tokens, mesh_s = asyncio.run(mesh(model_dir, args.groups, args.n, args.max_tokens, tmp))
    raw_tps, mesh_tps = raw_tokens / raw_s, mesh_tokens / mesh_s
    print(f"\n{'path':<34}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'raw vLLM AsyncLLM.generate':<34}{raw_tokens:>10}{raw_s:>10.2f}{raw_tps:>12.0f}")
    print(f"{'rollout server via queue + reward':<34}{mesh_tokens:>10}{mesh_s:>10.2f}{mesh_tps:>12.0f}")
    print(f"ratio (rollout server / raw vLLM): {mesh_tps / raw_tps:.2f}  "
          f"[{args.groups} groups x {args.n} samples, max_tokens {args.max_tokens}]")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"raw_tokens_per_s": raw_tps, "mesh_tokens_per_s": mesh_tps,
                                               "ratio": mesh_tps / raw_tps}, indent=2))


if __name__ == "__main__":
    main()
