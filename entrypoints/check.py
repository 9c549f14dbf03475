"""`rlmesh check -c CONFIG [overrides]`: a pre-flight that says whether RL can start on this model,
data and reward before a run spends its hours. It loads the tokenizer as the run will and prints one
rendered prompt token by token, then starts what `rlmesh eval` starts (the reward server and one
rollout server loading the model through vLLM, with a stand-in control plane) and sends a few
held-out prompts greedily and a few training prompts as groups at the run's temperature and group
size, scored by the run's reward. It prints greedy and sampled accuracy, the share of groups that
carry a signal (not every reward equal: only those teach GRPO anything), completion lengths and the
share cut at `rollout.max_tokens`, the reward components' means (format and extraction hits), and a
verdict in words. Exit 0 when groups carry a signal, 1 when none does or the check could not run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rlmesh.learner.rl.watch import RunStalled
from rlmesh.services.progress import progress
from rlmesh.services.config import HFModelSection, RunConfig
from rlmesh.preflight import check_model_fits, printable

CUT = "length"  # vLLM's finish reason for a completion stopped by max_tokens


def rendered_prompt(config: RunConfig, model_dir: str) -> tuple[str, list[str]]:
    """The first training prompt as the run renders it: its text, and each token as text."""
    from transformers import AutoTokenizer

    from rlmesh.learner.data.examples import in_order
    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.services.domain.chat import make_codec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    codec = make_codec(tokenizer, config.prompt)
    train, _ = load_dataset(config.data, config.run.seed)
    example = in_order(train).at(0)
    ids = codec.prompt(example.prompt_messages, example.tools or None)
    return codec.format, [tokenizer.decode([i]) for i in ids]


def summarize(greedy: list, groups: list, max_tokens: int) -> dict:
    """The numbers of the pre-flight from the greedy samples and the sampled groups (protobuf)."""
    from rlmesh.learner.rl.evaluator import CORRECT, greedy_accuracy

    samples = [s for g in groups for s in g.samples if not s.error]
    scored_groups = [[s.reward for s in g.samples if not s.error] for g in groups]
    with_signal = sum(1 for r in scored_groups if len(set(r)) > 1)
    lengths = [len(s.completion.token_ids) for s in samples]
    components = sorted({k for s in samples for k in s.reward_components})
    accuracy, from_env = greedy_accuracy(greedy) if greedy else (0.0, False)
    correct = [s.reward_components.get(CORRECT, s.reward) for s in samples]
    errors = [s.error for g in groups for s in g.samples if s.error] + [s.error for s in greedy if s.error]
    return {
        "greedy_accuracy": accuracy, "greedy_accuracy_source": "env_correct" if from_env else "mean_reward",
        "num_greedy": len(greedy), "num_groups": len(groups), "num_groups_with_signal": with_signal,
        "sampled_accuracy": sum(correct) / len(correct) if correct else 0.0,
        "reward_mean": sum(s.reward for s in samples) / len(samples) if samples else 0.0,
        "completion_tokens_mean": statistics.fmean(lengths) if lengths else 0.0,
        "completion_tokens_max": max(lengths, default=0), "max_tokens": max_tokens,
        "share_cut_at_max_tokens": sum(1 for s in samples if s.finish_reason == CUT) / max(len(samples), 1),
        "component_means": {k: sum(s.reward_components.get(k, 0.0) for s in samples) / len(samples)
                            for k in components},
        "num_errors": len(errors), "errors": sorted(set(errors))[:5],
        "example_completion": samples[0].text[:300] if samples else "",
    }


def verdict(summary: dict) -> str:
    n, signal = summary["num_groups"], summary["num_groups_with_signal"]
    cut = summary["share_cut_at_max_tokens"]
    if n and not signal:
        return (f"{cut:.0%} of completions were cut at rollout.max_tokens={summary['max_tokens']}; " if cut > 0.25
                else "") + (f"{signal} of {n} groups carry a signal: every sample of each group scored the same, so no GRPO "
                "step would learn (dynamic sampling would drop them all). Try: rollout.temperature higher, "
                "algorithm.group_size larger, easier data, a prompt that fits the model (prompt.format, "
                "prompt.prefix with solved examples, prompt.stop), a larger rollout.max_tokens if completions are "
                "cut, or a warm start (sft.num_steps)")
    note = (f"; {cut:.0%} of completions were cut at rollout.max_tokens={summary['max_tokens']}: consider raising it"
            if cut > 0.25 else "")
    return f"{signal} of {n} groups carry a signal ({signal / max(n, 1):.0%}): RL can start{note}"


async def preflight(stand_in, config: RunConfig, num_groups: int, num_greedy: int, timeout_s: float) -> dict:
    """Greedy answers to `num_greedy` held-out prompts and `num_groups` sampled training groups."""
    from rlmesh.learner.data.examples import in_order

    issuer, train = stand_in.issuer, in_order(stand_in.train_set)
    wanted: dict[str, str] = {}
    for ex in stand_in.eval_set[:num_greedy]:
        group = issuer.prompt_group(ex, "eval", 1, 0, greedy=True)
        await issuer.publish(group)
        wanted[group.group_id] = "greedy"
    for i in range(num_groups):
        group = issuer.prompt_group(train.at(i), "train", config.algorithm.group_size, 0, greedy=False)
        await issuer.publish(group)
        wanted[group.group_id] = "sampled"
    greedy, groups, t0 = [], [], time.monotonic()
    bar = progress(len(wanted), "rlmesh check", "prompt groups back")
    while any(issuer.ledger.holds(gid) for gid in wanted):
        for entry, group in await stand_in.reader.read(0):
            await stand_in.reader.trajectories.ack(entry.id)
            kind = wanted.get(group.group_id)
            if kind is None or not issuer.ledger.holds(group.group_id):
                continue
            issuer.ledger.returned(group.group_id)
            (greedy.extend(group.samples[:1]) if kind == "greedy" else groups.append(group))
            bar.update(1)
        if time.monotonic() - t0 > timeout_s:
            raise RunStalled(f"{sum(issuer.ledger.holds(g) for g in wanted)} prompt groups not back after "
                             f"{timeout_s:.0f}s")
    bar.close()
    return summarize(greedy, groups, config.rollout.max_tokens)


def report(fmt: str, tokens: list[str], summary: dict, seconds: float) -> str:
    shown = "".join(f"[{t}]".replace("\n", "\\n") for t in tokens[:120]) + (" ..." if len(tokens) > 120 else "")
    comps = ", ".join(f"{k} {v:.2f}" for k, v in summary["component_means"].items()) or "none"
    lines = [
        f"prompt format: {fmt}; the first training prompt, {len(tokens)} tokens, each in []:",
        f"  {printable(shown)}",
        f"greedy accuracy: {summary['greedy_accuracy']:.3f} on {summary['num_greedy']} held-out prompts "
        f"({summary['greedy_accuracy_source']})",
        f"sampled: accuracy {summary['sampled_accuracy']:.3f}, mean reward {summary['reward_mean']:.3f} over "
        f"{summary['num_groups']} groups",
        f"groups with a signal: {summary['num_groups_with_signal']} of {summary['num_groups']}",
        f"completion tokens: mean {summary['completion_tokens_mean']:.1f}, max {summary['completion_tokens_max']}; "
        f"cut at max_tokens ({summary['max_tokens']}): {summary['share_cut_at_max_tokens']:.0%}",
        f"reward components (means): {comps}",
        f"a sampled completion: {printable(summary['example_completion'][:200])!r}",
    ]
    if summary["num_errors"]:
        lines.append(f"errors: {summary['num_errors']} ({'; '.join(printable(e[:200]) for e in summary['errors'])})")
    lines.append(f"verdict: {verdict(summary)}")
    lines.append(f"({seconds:.0f}s)")
    return "\n".join(lines)


def run_check(config: RunConfig, args: argparse.Namespace) -> int:
    from rlmesh.evaluate import run_stand_in

    t0 = time.monotonic()
    if not isinstance(config.model, HFModelSection):
        raise SystemExit("rlmesh check: needs model.type=hf with model.path (a tiny random model has nothing to "
                         "check)")
    check_model_fits(config, config.model.path, "check")  # before any output is made
    output = Path(args.output or Path(config.run.output_dir) / f"check-{time.strftime('%Y%m%d-%H%M%S')}")
    output.mkdir(parents=True, exist_ok=True)
    try:
        fmt, tokens = rendered_prompt(config, config.model.path)
    except ValueError as err:
        print(f"rlmesh check: the prompt cannot be rendered: {printable(str(err))}", file=sys.stderr)
        return 1
    print(f"rlmesh check: prompt format {fmt}, {len(tokens)} prompt tokens", flush=True)
    resolved = config.model_copy(deep=True)
    resolved.sft.num_steps = 0
    code, summary = run_stand_in(
        "check", config, resolved, output, args.timeout,
        lambda stand_in: preflight(stand_in, config, args.groups, args.greedy, args.timeout),
        f"checking {config.model.path}")
    if summary is None:
        return code
    seconds = time.monotonic() - t0
    (output / "check.json").write_text(json.dumps({**summary, "prompt_format": fmt, "prompt_tokens": tokens,
                                                   "verdict": verdict(summary), "seconds": seconds}, indent=2))
    print(report(fmt, tokens, summary, seconds))
    return 0 if summary["num_groups_with_signal"] else 1
