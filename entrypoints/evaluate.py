"""`rlmesh eval -c CONFIG --model DIR|RUN_DIR[:STEP]`: held-out greedy accuracy and pass@k of one
model, through the real tiers. It starts what `rlmesh up` starts for a run — the embedded Valkey,
the reward server and one rollout server loading the model — and, in place of the learner, a
control plane that admits the rollout server at version 0 (the weights it loaded). The eval
prompts go through the prompt stream exactly as the learner's evaluations do (the same
`Evaluator`: a greedy completion per prompt, and `learner.eval_num_samples` sampled ones when
`learner.eval_pass_k` is set), so multi-turn environments and remote ones work as in training.
Prints a table per environment and writes `eval.json` (and the first greedy answers,
`eval_samples.jsonl`) to the output directory."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmesh.learner.rl.watch import RunStalled, StallWatch, failure_limit
from rlmesh.processes import Mesh, stop_signals_interrupt
from rlmesh.services.config import HFModelSection, RunConfig, dump_config
from rlmesh.preflight import check_model_fits, printable

if TYPE_CHECKING:
    from rlmesh.learner.rl.issuer import PromptIssuer

log = logging.getLogger("rlmesh.eval")


def resolve_model(spec: str, workdir: Path) -> Path:
    """An HF model directory from `DIR` (config.json in it) or `RUN_DIR[:STEP]` (a run's checkpoint:
    its `model/` when written, else exported from the DCP shards into `workdir`)."""
    from rlmesh.learner.train.checkpoint import export_hf, find_checkpoint

    path, _, step = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    root = Path(path)
    if (root / "config.json").is_file():
        return root
    if not (root / "checkpoints").is_dir():
        raise ValueError(f"--model {spec!r} is neither an HF model directory (config.json) nor a run directory "
                         "(checkpoints/step_*); give one, with :STEP for a run's checkpoint other than the newest")
    if step and not step.isdigit():
        raise ValueError(f"--model {spec!r}: the step after ':' must be a number, got {step!r}")
    checkpoint = find_checkpoint(root, int(step) if step else None)
    if (checkpoint / "model" / "config.json").is_file():
        return checkpoint / "model"
    # float32: what the learner trained, not its weights rounded to the starting model's dtype.
    return export_hf(checkpoint, workdir / f"model_{checkpoint.name}", dtype="float32")


class _Reader:
    """The trajectory stream read as the learner's evaluator expects (decoded groups, bad entries
    acked), watching what would otherwise leave the evaluation waiting in silence: a service that
    exited, prompt groups the rollout server rejected, groups whose every sample failed."""

    def __init__(self, trajectories, prompts, issuer, mesh: Mesh, watch: StallWatch) -> None:
        from rlmesh.learner.rl.watch import DeadLetters

        self.trajectories, self.issuer, self.mesh, self.watch = trajectories, issuer, mesh, watch
        self.dead_letters = DeadLetters(prompts)

    def check_services(self) -> None:
        for svc in self.mesh.services:
            if (code := svc.proc.poll()) is not None:
                raise RunStalled(f"the {svc.name} server exited with code {code}; last lines of {svc.log_path}:\n"
                                 f"{svc.tail(15)}")

    async def read(self, version: int) -> list:
        from google.protobuf.message import DecodeError

        from rlmesh.v1 import common_pb2

        self.check_services()
        for group_id, by, reason in await self.dead_letters.poll():
            if self.issuer.ledger.holds(group_id):
                self.issuer.ledger.returned(group_id)
                self.watch.failed(f"rollout server {by}", reason, by)
        out = []
        for entry in await self.trajectories.read("learner", count=256, block_ms=500):
            try:
                group = common_pb2.TrajectoryGroup.FromString(entry.data)
            except DecodeError:
                await self.trajectories.ack(entry.id)
                continue
            errors = [s.error for s in group.samples if s.error]
            if group.samples and len(errors) == len(group.samples):
                self.watch.group_failed(group, errors[0])
            else:
                self.watch.succeeded()
            out.append((entry, group))
        return out


class _Records:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, record: dict) -> None:
        self.rows.append(record)


@dataclass
class StandIn:
    """What a command that stands in for the learner works with, once the rollout server is ready."""

    issuer: PromptIssuer
    reader: _Reader
    train_set: Any
    eval_set: list
    watch: StallWatch


Body = Callable[[StandIn], Awaitable[dict]]


async def _held_out(stand_in: StandIn, config: RunConfig, timeout_s: float, output: Path) -> dict:
    """`rlmesh eval`'s work: one evaluation of the held-out set (its first answers to eval_samples.jsonl)."""
    from rlmesh.learner.rl.evaluator import Evaluator
    from rlmesh.learner.trackers.metrics import MetricsWriter

    samples = MetricsWriter(output, "eval_samples.jsonl") if config.logging.eval_samples else None
    evaluator = Evaluator(stand_in.eval_set, stand_in.issuer, stand_in.reader.trajectories, _Records(),
                          check=lambda group, version: "", timeout_s=timeout_s, pass_k=config.learner.eval_pass_k,
                          num_samples=config.learner.eval_num_samples, samples=samples,
                          samples_per_round=config.logging.eval_samples)
    try:
        return await evaluator.run(0, [], stand_in.reader.read)
    finally:
        if samples is not None:
            samples.close()


async def _stand_in(config: RunConfig, port: int, timeout_s: float, mesh: Mesh, output: Path, body: Body) -> dict:
    """Serve the stand-in control plane on `port`, wait for the rollout server, run `body`.
    Raises RunStalled when it cannot finish (a service exited, every prompt fails)."""
    from rlmesh.learner.data.sources import load_dataset
    from rlmesh.learner.rl.server import partial_learner

    learner = await partial_learner(config, port)
    try:
        train_set, eval_set = load_dataset(config.data, config.run.seed)
        watch = StallWatch(_Records(), failure_limit=min(failure_limit(config.learner), max(len(eval_set), 1)),
                           log_hint=str(output / "logs" / "{service}.log"))
        reader = _Reader(learner.trajectories, learner.prompts, learner.issuer, mesh, watch)
        t0 = said = time.monotonic()
        while not learner.membership.generators:
            reader.check_services()
            if time.monotonic() - said > 60:
                said = time.monotonic()
                print(f"rlmesh: still waiting for the rollout server after {said - t0:.0f}s (vLLM loading; "
                      f"{output / 'logs' / 'rollout-0.log'})", flush=True)
            if time.monotonic() - t0 > timeout_s:
                raise RunStalled(f"no rollout server registered within {timeout_s:.0f}s; see "
                                 f"{output / 'logs' / 'rollout-0.log'}")
            await asyncio.sleep(0.5)
        print(f"rlmesh: rollout server ready after {time.monotonic() - t0:.0f}s", flush=True)
        return await body(StandIn(learner.issuer, reader, train_set, eval_set, watch))
    finally:
        await learner.server.stop(1.0)


def table(record: dict) -> str:
    """Greedy accuracy and pass@k per environment (and over all), as aligned text."""
    ks = sorted(int(k) for k in next(iter(record.get("pass_at_k", {}).values()), {}))
    header = ["environment", "greedy", *(f"pass@{k}" for k in ks)]
    by_env = record.get("accuracy_by_env") or {}
    rows = [[env, f"{acc:.3f}", *(f"{record['pass_at_k'].get(env, {}).get(str(k), float('nan')):.3f}" for k in ks)]
            for env, acc in sorted(by_env.items())]
    rows.append(["all", f"{record['accuracy']:.3f}", *(f"{record[f'pass@{k}']:.3f}" for k in ks)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [header, *rows])


def stand_in_cores(config: RunConfig) -> str:
    """The rollout server's cores beside a stand-in learner, which trains nothing: the run's rollout and
    learner cores together where both are listed (the demo's '0' and '1' -> '0,1'), else the run's own."""
    from rlmesh.services.affinity import UNPINNED, parse_cores

    rollout, learner = config.rollout.cpu_cores, config.learner.cpu_cores
    if {rollout, learner} & set(UNPINNED):
        return rollout
    return ",".join(str(c) for c in sorted(parse_cores(rollout) | parse_cores(learner)))


def _serve_stand_in(mesh: Mesh, config: RunConfig, resolved: RunConfig, output: Path, timeout_s: float,
                    body: Body, what: str) -> dict:
    """Start the reward and rollout servers for `resolved.model`, then run `body` in place of the
    learner (`_stand_in`); `what` is said on the console while vLLM loads."""
    from rlmesh.services.ports import free_port

    dump_config(config, output / "config.yaml")
    mesh.pass_secrets(config, resolved)
    os.environ.update(mesh.env or {})  # this process is the stand-in learner: same token and queue password
    learner_port, reward_port = free_port(), free_port()
    host = config.network.host
    resolved.network.learner_address = f"{host}:{learner_port}"
    resolved.network.reward_address = f"{host}:{reward_port}"
    resolved.reward.env_processes = []
    resolved.rollout.cpu_cores = stand_in_cores(config)
    dump_config(resolved, output / "config.resolved.yaml")
    base = ["-c", str(output / "config.resolved.yaml")]
    mesh.spawn("reward", ["reward", *base, "--port", str(reward_port)])
    mesh.spawn("rollout-0", ["rollout", *base, "--port", "0", "--generator-id", "rollout-0"])
    try:
        mesh.wait_serving(config.network, {"reward": reward_port})
    except SystemExit as err:
        raise RunStalled(str(err).removeprefix("rlmesh up: ")) from None
    print(f"rlmesh: {what}; rollout server loading vLLM", flush=True)
    return asyncio.run(_stand_in(resolved, learner_port, timeout_s, mesh, output, body))


def run_stand_in(command: str, config: RunConfig, resolved: RunConfig, output: Path, timeout_s: float,
                 body: Body, what: str) -> tuple[int, dict | None]:
    """`rlmesh <command>`'s services and its stand-in learner running `body`: (0, its result), or (the
    exit code, None) when interrupted (130) or when it cannot finish (1), said on the console. Every
    service it started is stopped however it ends, a signal while stopping included."""
    mesh = Mesh(output)
    with stop_signals_interrupt() as shield:
        try:
            return 0, _serve_stand_in(mesh, config, resolved, output, timeout_s, body, what)
        except KeyboardInterrupt:
            print(f"\nrlmesh {command}: interrupted; stopping every service", file=sys.stderr, flush=True)
            return 130, None
        except RunStalled as err:
            print(f"rlmesh {command}: {printable(str(err))}", file=sys.stderr, flush=True)
            return 1, None
        finally:
            shield()
            mesh.stop()


def run_eval(config: RunConfig, args: argparse.Namespace) -> int:
    output = Path(args.output or Path(config.run.output_dir) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}")
    made = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        try:
            model = resolve_model(args.model, output)
        except ValueError as err:
            raise SystemExit(f"rlmesh eval: {err}") from None
        check_model_fits(config, str(model), "eval")
    except BaseException:
        if made:  # a model that is not there or does not fit leaves no output behind
            shutil.rmtree(output, ignore_errors=True)
        raise
    resolved = config.model_copy(deep=True)
    resolved.model = HFModelSection(path=str(model.resolve()))
    resolved.sft.num_steps = 0
    what = f"{model} on {len(config.learner.eval_pass_k) and 'greedy + pass@k' or 'greedy'}"
    code, record = run_stand_in("eval", config, resolved, output, args.timeout,
                                lambda stand_in: _held_out(stand_in, config, args.timeout, output), what)
    if record is None:
        return code
    record = {**record, "model": str(model), "config": str(args.config)}
    (output / "eval.json").write_text(json.dumps(record, indent=2))
    if "accuracy_by_env" not in record:
        record["accuracy_by_env"] = {}
    print(table(record))
    print(f"rlmesh eval: {record['num_prompts']} held-out prompts; written to {output / 'eval.json'}")
    return 0
