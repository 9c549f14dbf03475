"""Rollout-tier throughput against raw vLLM, side by side, on the same tiny model and prompts.

baseline: vLLM's AsyncLLM.generate called directly for G prompt groups x n samples, with the engine
          set up as the rollout server sets it up (on a CPU, the model in vLLM's engine-core process:
          `rlmesh.rollout_server.vllm_engine.executor_args`), so the ratio is what the server adds or loses
          around the same engine. vLLM's default executor (a worker process of its own, whose OpenMP
          threads share the cores with the engine core) is run too and printed beside it, for reference.
measured: the same G groups through the real mesh path: prompt stream (Valkey) -> `rlmesh rollout`
          (vLLM + tokenisation + versions + logprobs) -> `rlmesh reward` (gRPC Score) ->
          trajectory stream.
Prints generated tokens/s of each and their ratio. Run: python bench/rollout_throughput.py
Real model (--model DIR): the demo's prompts (examples/smollm2_grpo.yaml's data, its prompt template
and `math` environment), its sampling (temperature 0.7, --max-tokens 192) and --dtype, e.g.
python bench/rollout_throughput.py --model models/smollm2-135m-instruct --groups 16 --max-tokens 192
--prefix-caching BLOCK: both sides run vLLM with prefix caching and BLOCK-token KV blocks (the demo's
rollout.enable_prefix_caching and rollout.block_size); the raw side starts a group's samples together,
the rollout server starts the rest of a group once its first sample is prefilled (so they reuse the
prompt's KV), which is what the ratio then measures."""

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



DEMO_DATA = REPO / "examples/data/reasoning_one_step/train.parquet"
DEMO_TEMPLATE = "{prompt} Put the final answer in \\boxed{{}}."


def tiny_items(count: int) -> list[tuple[str, str, str]]:
    """(user message, environment, answer) of the tiny model's arithmetic prompts."""
    return [(f"{i % 10}+{i % 7}=", "arithmetic", str(i % 10 + i % 7)) for i in range(count)]


def demo_items(count: int) -> list[tuple[str, str, str]]:
    """The real-model demo's prompts: its training questions under its template, scored by `math`."""
    import pyarrow.parquet as pq

    table = pq.read_table(DEMO_DATA).to_pylist()
    return [(DEMO_TEMPLATE.format(prompt=row["question"]), "math", str(row["final"])) for row in table[:count]]


async def raw_vllm(model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int, dtype: str = "float32",
                   temperature: float = 1.0, max_model_len: int = 256,
                   block_size: int | None = None, warm_up: list[list[int]] | None = None,
                   executor: dict | None = None) -> tuple[int, float]:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), dtype=dtype, enforce_eager=True,
                                                       max_model_len=max_model_len,
                                                       enable_prefix_caching=block_size is not None,
                                                       **({"block_size": block_size} if block_size else {}),
                                                       disable_log_stats=True, **(executor or {})))
    params = SamplingParams(n=1, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(ids):
        final = None
        async for out in engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
            final = out
        return len(final.outputs[0].token_ids)

    # Warm up as the mesh side does (8 groups x n samples), on prompts the measured round does not send
    # (with prefix caching they would be cached): the first batch as large as the measured round's pays
    # the kernels' first-call costs for its shapes, which 8 lone samples did not.
    await asyncio.gather(*(one(p) for p in (warm_up or prompts[:8])[:8] for _ in range(n)))
    t0 = time.monotonic()
    counts = await asyncio.gather(*(one(p) for p in prompts for _ in range(n)))
    elapsed = time.monotonic() - t0
    engine.shutdown()
    return sum(counts), elapsed


async def mesh(model_dir: Path, num_groups: int, n: int, max_tokens: int, tmp: Path, rollout: dict | None = None,
               system: str | None = None, items: list[tuple[str, str, str]] | None = None) -> tuple[int, float]:
    """The mesh path; `rollout` overrides the rollout config, `system` prepends a shared system prompt,
    `items` are the (user message, environment, answer) to send (default: the tiny arithmetic ones)."""
    from bench.harness import rollout_harness
    from rlmesh.v1 import common_pb2
    from rlmesh.services.queue import StreamQueue, connect

    rollout_cfg = {"max_tokens": max_tokens, "max_concurrent_groups": 256, "max_model_len": 256, **(rollout or {})}
    async with rollout_harness(model_dir, tmp, rollout=rollout_cfg, with_reward=True, rpc_timeout_s=60) as h:
        redis = connect(h.queue_url)
        prompts = StreamQueue(redis, "rlmesh:prompts", group="rollout")
        trajectories = StreamQueue(redis, "rlmesh:trajectories", group="learner")
        await trajectories.ensure_group()

        sent = items or tiny_items(num_groups)

        async def run_round(count: int, first: int = 0) -> int:
            for i in range(first, first + count):
                content, env, answer = sent[i % len(sent)]
                g = common_pb2.PromptGroup(group_id=uuid.uuid4().hex, env_name=env, n=n,
                                           messages=[common_pb2.ChatMessage(role="user", content=content)])
                if system:
                    g.messages.insert(0, common_pb2.ChatMessage(role="system", content=system))
                g.env_metadata.update({"answer": answer})
                await prompts.publish(g.group_id, g.SerializeToString())
            tokens, got = 0, 0
            while got < count:
                for e in await trajectories.read("bench", count=256, block_ms=1000):
                    t = common_pb2.TrajectoryGroup.FromString(e.data)
                    tokens += sum(len(s.completion.token_ids) for s in t.samples)
                    got += 1
                    await trajectories.ack(e.id)
            return tokens

        await run_round(8, num_groups)  # warm-up, on prompts the measured round does not send
        t0 = time.monotonic()
        tokens = await run_round(num_groups)
        return tokens, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64, help="prompt groups per measured round")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=64, help="completion length cap")
    parser.add_argument("--model", help="an HF model directory (the demo's prompts and sampling) instead of the tiny one")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's dtype, both sides")
    parser.add_argument("--temperature", type=float, default=None, help="default 1.0 (tiny), 0.7 (--model)")
    parser.add_argument("--prefix-caching", type=int, metavar="BLOCK", default=None,
                        help="both sides with vLLM prefix caching and BLOCK-token KV blocks (CPU: a multiple of 32)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from transformers import AutoTokenizer

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    tmp = Path(tempfile.mkdtemp(prefix="rlmesh-bench-"))
    if args.model:
        model_dir, items, max_len = Path(args.model).resolve(), demo_items(args.groups + 8), 512
        temperature = 0.7 if args.temperature is None else args.temperature
    else:
        model_dir, items, max_len = write_tiny_model(TinyModelSection(), tmp / "model"), tiny_items(args.groups + 8), 256
        temperature = 1.0 if args.temperature is None else args.temperature
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for content, _, _ in items]
    from rlmesh.rollout_server.vllm_engine import executor_args

    def raw(executor: dict | None) -> tuple[int, float]:
        return asyncio.run(raw_vllm(model_dir, prompts[:args.groups], args.n, args.max_tokens, args.dtype,
                                    temperature, max_len, args.prefix_caching, prompts[args.groups:], executor))

    server_executor = executor_args()
    raw_tokens, raw_s = raw(server_executor)
    default_tokens, default_s = raw(None) if server_executor else (raw_tokens, raw_s)
    rollout = {"dtype": args.dtype, "temperature": temperature, "max_model_len": max_len}
    if args.prefix_caching:
        rollout.update(enable_prefix_caching=True, block_size=args.prefix_caching)
    mesh_tokens, mesh_s = asyncio.run(mesh(model_dir, args.groups, args.n, args.max_tokens, tmp, rollout, items=items))
    raw_tps, mesh_tps, default_tps = raw_tokens / raw_s, mesh_tokens / mesh_s, default_tokens / default_s
    print(f"\n{'path':<44}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'raw vLLM AsyncLLM.generate (server executor)':<44}{raw_tokens:>10}{raw_s:>10.2f}{raw_tps:>12.0f}")
    print(f"{'raw vLLM, its default executor (reference)':<44}{default_tokens:>10}{default_s:>10.2f}{default_tps:>12.0f}")
    print(f"{'rollout server via queue + reward':<44}{mesh_tokens:>10}{mesh_s:>10.2f}{mesh_tps:>12.0f}")
    print(f"ratio (rollout server / raw vLLM): {mesh_tps / raw_tps:.2f}  "
          f"[{model_dir.name}, {args.dtype}, {args.groups} groups x {args.n} samples, max_tokens {args.max_tokens}, "
          f"temperature {temperature}"
          + (f", prefix caching, {args.prefix_caching}-token blocks" if args.prefix_caching else "") + "]")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps({"raw_tokens_per_s": raw_tps, "mesh_tokens_per_s": mesh_tps,
                                               "ratio": mesh_tps / raw_tps,
                                               "raw_default_executor_tokens_per_s": default_tps}, indent=2))


if __name__ == "__main__":
    main()
