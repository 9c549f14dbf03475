"""CPU seconds an agent episode costs the reward tier: the demo's OpenAI Agents SDK agent
(examples/agents/word_problems.py) run as rlmesh runs it (`module:function`: a launcher imports it once
and forks each episode from it), against the same agent started as a fresh process per episode (a
command agent whose process imports the module and calls the function: what the tier did before the
launcher). Both talk to a real agent endpoint on loopback whose model is scripted (the reply text is
fixed, so the bench measures the agent's process, not generation).

Measured: CPU seconds (user + system) of the agent processes, read from the reaped children's rusage
after the agents are closed, per episode; wall seconds per episode; and the ratio fresh ÷ forked.
Run: python bench/agent_episodes.py [--episodes 32 --concurrency 8]"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

AGENT = "examples.agents.word_problems:solve"
FRESH = [sys.executable, "-c",
         "import json, sys\nfrom examples.agents.word_problems import solve\n"
         "task = json.load(sys.stdin)\nprint(json.dumps(solve(task['prompt'], task['metadata'])))"]
REPLIES = ("Twelve apples and three more make 15 apples.", "15")


class ScriptedModel:
    """The endpoint's generator: each episode's calls get the fixed replies in turn."""

    def __init__(self) -> None:
        from rlmesh.learner.devtools.tiny_model import build_tokenizer
        from rlmesh.services.domain.chat import ChatCodec

        self.tokenizer, self.version, self.model_path = build_tokenizer("bpe"), 0, "/models/scripted"
        self.codec = ChatCodec(self.tokenizer)
        self.calls = 0

    def sampling_params(self, group, index, *, max_tokens=None, turn=0):
        return SimpleNamespace(max_tokens=max_tokens)

    async def generate_ids(self, prompt_ids, params, request_id, on_text=None):
        from rlmesh.rollout_server.generator import Generation

        text = REPLIES[self.calls % 2]
        self.calls += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.codec.eos_id]
        return Generation(ids, [-0.5] * len(ids), "stop", text, 0, 0)


async def measure(path: str | list[str], episodes: int, concurrency: int) -> dict:
    from rlmesh.reward_server.environments.agent import AgentEnvironment
    from rlmesh.rollout_server.agent_endpoint import AgentEndpoint
    from rlmesh.services.config import AgentEndpointSection, RolloutSection
    from rlmesh.v1 import common_pb2

    endpoint = AgentEndpoint(ScriptedModel(), AgentEndpointSection(enabled=True), RolloutSection(max_model_len=1024))
    env = AgentEnvironment("word_problems", path, timeout_s=120, max_concurrency=concurrency)
    prompt = [{"role": "user", "content": "Ann has 12 apples and buys 3 more. How many apples has she?"}]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    await endpoint.start()
    started = time.monotonic()
    try:
        async def one(i: int) -> bool:
            episode = endpoint.open(common_pb2.PromptGroup(group_id=f"g{i}", n=1), 0)
            result = await env.run(prompt, {"answer": 15}, endpoint.url, episode.key)
            endpoint.close(episode)
            return not result.error and result.reward == 1.0

        ok = await asyncio.gather(*(one(i) for i in range(episodes)))
        wall = time.monotonic() - started
    finally:
        env.close()  # the launcher exits and is reaped: its children's CPU is in RUSAGE_CHILDREN
        await endpoint.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not all(ok):
        raise SystemExit(f"{path}: {ok.count(False)} of {episodes} episodes failed or scored 0")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_per_episode_s": cpu / episodes, "wall_per_episode_s": wall / episodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="episodes running at once (reward.agent_max_concurrency)")
    args = p.parse_args()
    forked = asyncio.run(measure(AGENT, args.episodes, args.concurrency))
    fresh = asyncio.run(measure(FRESH, args.episodes, args.concurrency))
    print(f"{args.episodes} episodes of {AGENT}, {args.concurrency} at once, 2 model calls each (scripted model)")
    print(f"{'':>28} {'CPU s/episode':>14} {'wall s/episode':>15}")
    for name, r in (("fresh process per episode", fresh), ("forked from the launcher", forked)):
        print(f"{name:>28} {r['cpu_per_episode_s']:14.3f} {r['wall_per_episode_s']:15.3f}")
    print(f"fresh / forked: CPU {fresh['cpu_per_episode_s'] / forked['cpu_per_episode_s']:.1f}x, "
          f"wall {fresh['wall_per_episode_s'] / forked['wall_per_episode_s']:.1f}x")


if __name__ == "__main__":
    main()
