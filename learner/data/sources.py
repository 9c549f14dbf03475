"""Prompt datasets: generated arithmetic problems, JSONL files, anything Hugging Face `datasets`
reads (`rlmesh.learner.data.hf`), a reasoning-gym dataset (`rlmesh.learner.data.reasoning_gym`), a
TextArena game's seeds or a `verifiers` environment's dataset, as `Example`s in a training order
(`rlmesh.learner.data.examples`)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from rlmesh.learner.data.examples import Example, TrainData, TrainOrder, assistant_turn
from rlmesh.services.child_env import child_env
from rlmesh.services.config import (ArithmeticDataSection, CalculatorDataSection, DataSection, HFDataSection,
                                    JsonlDataSection, ReasoningGymDataSection, RewardSection, TextArenaDataSection,
                                    VerifiersDataSection)
from rlmesh.services.domain.tasks import ADD_TOOL, calculator_prompt


def _arithmetic(cfg: ArithmeticDataSection, seed: int) -> tuple[list[Example], list[Example]]:
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    problems = [
        (a, op, b)
        for op in cfg.ops
        for a in range(cfg.max_operand + 1)
        for b in range(cfg.max_operand + 1)
    ]
    random.Random(seed).shuffle(problems)
    if cfg.num_eval >= len(problems):
        raise ValueError(
            f"data.num_eval={cfg.num_eval} leaves no training problems out of {len(problems)} "
            "distinct ones; lower data.num_eval or raise data.max_operand"
        )
    examples = []
    for a, op, b in problems:
        answer = str(ops[op](a, b))
        # One preference pair per problem for `rlmesh dpo`: the answer over the answer with the
        # stray "!" the demo's noisy warm start learns (the habit GRPO unlearns in the demo).
        examples.append(Example(id=f"{a}{op}{b}", messages=[{"role": "user", "content": f"{a}{op}{b}="}],
                                env=cfg.env_name, metadata={"answer": answer}, chosen=answer, rejected=f"{answer}!"))
    eval_set = examples[: cfg.num_eval]
    train = examples[cfg.num_eval :][: cfg.num_train]
    return train, eval_set


def _calculator(cfg: CalculatorDataSection, seed: int) -> tuple[list[Example], list[Example]]:
    """Tool-use problems: two operands too large for a tiny model to add in its weights. Each example
    carries the `add` tool and a demonstration (call the tool, read its result, answer)."""
    rng = random.Random(seed)
    span = cfg.max_operand - cfg.min_operand + 1
    if span * span < cfg.num_train + cfg.num_eval:
        raise ValueError(f"data: [{cfg.min_operand}, {cfg.max_operand}] gives {span * span} operand pairs, fewer than "
                         f"num_train + num_eval = {cfg.num_train + cfg.num_eval}; widen the range")
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < cfg.num_train + cfg.num_eval:
        pairs.add((rng.randint(cfg.min_operand, cfg.max_operand), rng.randint(cfg.min_operand, cfg.max_operand)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    examples = []
    for a, b in ordered:
        prompt = [{"role": "user", "content": calculator_prompt(a, b)}]
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        demonstration = [*prompt, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "name": "add", "content": str(a + b)},
                         {"role": "assistant", "content": str(a + b)}]
        # The shortcut answers at once, repeating the first number: wrong, and one definite habit
        # (not a spread of guesses), so that it can be the warm start's greedy choice.
        examples.append(Example(id=f"{a}+{b}", messages=prompt, env=cfg.env_name,
                                metadata={"answer": a + b, "a": a, "b": b, "tool_call_reward": cfg.tool_call_reward},
                                tools=[ADD_TOOL],
                                demonstration=demonstration, shortcut=[*prompt, {"role": "assistant", "content": str(a)}]))
    return examples[cfg.num_eval:], examples[: cfg.num_eval]


def _textarena(cfg: TextArenaDataSection, seed: int) -> tuple[list[Example], list[Example]]:
    """One episode per game seed: held-out seeds first, then training seeds, so that none is in both and the
    held-out set does not change with `num_train`. The prompt is the system message alone (if any): the
    game's own rules are the episode's first observation."""
    first = seed * 1_000_003 if cfg.seed is None else cfg.seed
    system = [] if cfg.system_prompt is None else [{"role": "system", "content": cfg.system_prompt}]
    examples = [Example(id=f"{cfg.game}-{s}", messages=list(system), env=cfg.env_name,
                        metadata={"game": cfg.game, "seed": s})
                for s in range(first, first + cfg.num_eval + cfg.num_train)]
    return examples[cfg.num_eval:], examples[: cfg.num_eval]


def _verifiers(cfg: VerifiersDataSection, reward: RewardSection, seed: int) -> tuple[list[Example], list[Example]]:
    """The environment's own dataset, read by the interpreter that hosts the environment (its
    virtualenv has `verifiers` and the package; this one need not): the rows
    `rlmesh.reward_server.environments.verifiers_env` prints."""
    if cfg.env_name not in reward.verifiers:
        raise ValueError(f"data.env_name={cfg.env_name!r} names no environment of reward.verifiers "
                         f"({sorted(reward.verifiers) or 'none'})")
    env = reward.verifiers[cfg.env_name]
    spec = {"env_id": env.env_id, "args": env.args, "num_train": cfg.num_train, "num_eval": cfg.num_eval,
            "seed": seed if cfg.seed is None else cfg.seed}
    python = env.python or sys.executable
    try:
        # The author's code runs there: none of the learner's credentials go with it (docs/environments.md).
        out = subprocess.run([python, "-m", "rlmesh.reward_server.environments.verifiers_env", "rows", json.dumps(spec)],
                             capture_output=True, text=True, timeout=600,
                             env=child_env(["PYTHONPATH", *reward.env_server_env]))
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"data: cannot read the dataset of verifiers environment {env.env_id!r} with {python}: "
                         f"{err}") from err
    if out.returncode != 0:
        raise ValueError(f"data: reading the dataset of verifiers environment {env.env_id!r} with {python} failed "
                         f"(exit {out.returncode}):\n{out.stderr.strip()[-2000:]}")
    split: dict[str, list[Example]] = {"train": [], "eval": []}
    for line in out.stdout.splitlines():
        row = json.loads(line)
        metadata = {"answer": row["answer"], "info": row["info"], "example_id": row["example_id"],
                    **({"task": row["task"]} if "task" in row else {})}
        split[row["split"]].append(Example(id=f"{cfg.env_name}-{row['split']}-{row['example_id']}",
                                           messages=row["prompt"], env=cfg.env_name, metadata=metadata))
    if not split["train"] or not split["eval"]:
        raise ValueError(f"data: verifiers environment {env.env_id!r} gave {len(split['train'])} training and "
                         f"{len(split['eval'])} held-out prompts; its dataset needs more rows than data.num_eval")
    return split["train"], split["eval"]


def _jsonl(path: str, cfg: JsonlDataSection) -> list[Example]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg} at column {err.colno}); each line must be one JSON "
                             "object") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        if cfg.messages_key in row:
            messages = row[cfg.messages_key]
            if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                       for m in messages)):
                raise ValueError(f"{where}: {cfg.messages_key!r} must be a list of {{role, content}} objects")
        elif cfg.prompt_key in row:
            messages = [{"role": "user", "content": str(row[cfg.prompt_key])}]
        else:
            raise ValueError(f"{where}: needs {cfg.messages_key!r} (chat messages) or {cfg.prompt_key!r} "
                             "(data.messages_key / data.prompt_key)")
        if isinstance(row.get(cfg.metadata_key), dict):
            metadata = dict(row[cfg.metadata_key])
        else:
            metadata = {k: v for k, v in row.items() if k not in ("id", cfg.messages_key, cfg.prompt_key, "env")}
        if cfg.answer_key != "answer" and cfg.answer_key in row:
            metadata.setdefault("answer", row[cfg.answer_key])
        pair = {key: assistant_turn(row[name], f"{where}: {name!r}") if name in row else None
                for key, name in (("chosen", cfg.chosen_key), ("rejected", cfg.rejected_key))}
        for name in (cfg.chosen_key, cfg.rejected_key):
            metadata.pop(name, None)
        out.append(Example(id=str(row.get("id", i)), messages=messages, env=str(row.get("env", cfg.env_name)),
                           metadata=metadata, **pair))
    return out


def load_dataset(cfg: DataSection, seed: int, reward: RewardSection | None = None) -> tuple[TrainData, list[Example]]:
    """(train, eval) examples; the built-in kinds and JSONL files keep their order (a TrainOrder
    without shuffling), `data.type: hf` shuffles per epoch unless `data.shuffle=false`. `reward`
    (the run's reward section) names the environment a `data.type: verifiers` dataset comes from."""
    if isinstance(cfg, HFDataSection):
        from rlmesh.learner.data.hf import load_hf

        return load_hf(cfg, seed)
    if isinstance(cfg, ArithmeticDataSection):
        train, evals = _arithmetic(cfg, seed)
    elif isinstance(cfg, CalculatorDataSection):
        train, evals = _calculator(cfg, seed)
    elif isinstance(cfg, ReasoningGymDataSection):
        from rlmesh.learner.data.reasoning_gym import load_reasoning_gym

        train, evals = load_reasoning_gym(cfg, seed)
    elif isinstance(cfg, TextArenaDataSection):
        train, evals = _textarena(cfg, seed)
    elif isinstance(cfg, VerifiersDataSection):
        train, evals = _verifiers(cfg, reward or RewardSection(), seed)
    else:
        train, evals = _jsonl(cfg.train_path, cfg), _jsonl(cfg.eval_path, cfg)
    return TrainOrder(train), evals
