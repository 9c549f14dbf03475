"""`rlmesh up`: the whole mesh as local processes. Starts an embedded Valkey (unless queue.url
names a server), prepares the model (tiny model + SFT warm start when configured), then the
reward server, rollout server(s) and the learner on free ports; waits for health; shows progress.

It supervises: a service that crashes is restarted with exponential backoff (the learner resumes
from its newest checkpoint, a rollout server re-registers, pending work is claimed), up to
`run.max_restarts` times per service; then the run fails naming the service and quoting its log.
A service that dies while starting fails the launch at once with its own error. Every process is
stopped on success, Ctrl-C or failure."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlmesh.env_servers import start_env_servers
from rlmesh.learner.rl.watch import STALLED_EXIT
from rlmesh.preflight import check_model_fits, printable
from rlmesh.processes import Mesh, Service, stop_signals_interrupt
from rlmesh.services.config import HFModelSection, RunConfig, dump_config
from rlmesh.services.ports import free_port
from rlmesh.services.retry import Backoff

log = logging.getLogger("rlmesh.up")
# 1, 2, 4, ... 30 s between restarts of a crashed service (exact: the message says when).
RESTART_BACKOFF = Backoff(1.0, 30.0, jitter=0.0)
# An early rollout server's wait for the model being prepared (`--await-model`); a failed preparation stops the launch.
AWAIT_MODEL_S = 600


def run_up(config: RunConfig, args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] | None = None,
           env: dict[str, str] | None = None) -> int:
    """`rlmesh up`; also the body of `rlmesh.train`, which passes `on_row` (called with every new
    metrics.jsonl row, in order, as the run goes) and `env` (extra environment of every service)."""
    from rlmesh.learner.rl.stop import clear_requests, mark_seen
    from rlmesh.services.prom import RUN_DIR_ENV
    from rlmesh.services.telemetry import setup_logging

    setup_logging("up", config.logging.level, fmt=config.logging.format)
    # A model that is not there or does not fit is refused before anything is made or started.
    _check_model_path(config)
    if isinstance(config.model, HFModelSection):
        check_model_fits(config, config.model.path, "up")
    try:
        run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(config)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        option = "--run-dir" if args.run_dir else "run.output_dir"
        raise SystemExit(f"rlmesh up: cannot make the run directory ({err.strerror or err}: {err.filename}); give "
                         f"{option} a place this user can write") from None
    run_dir = run_dir.resolve()
    dump_config(config, run_dir / "config.yaml")
    clear_requests(run_dir)
    if on_row is not None:
        mark_seen(run_dir, 0)  # the learner waits for the callbacks to see each step before the next
    print(f"rlmesh up: run directory {run_dir}", flush=True)
    # Services write their metrics ports (and span files) into the run directory.
    mesh = Mesh(run_dir, {**(env or {}), RUN_DIR_ENV: str(run_dir)})
    interrupted = False
    with stop_signals_interrupt() as shield:
        try:
            return _run(mesh, config, run_dir, on_row)
        except KeyboardInterrupt:
            interrupted = True
            print("\nrlmesh up: interrupted; stopping every service", file=sys.stderr, flush=True)
            return 130
        finally:
            shield()
            mesh.stop()
            if not interrupted:
                print(f"rlmesh up: all services stopped; outputs in {run_dir}", flush=True)


def new_run_dir(config: RunConfig) -> Path:
    """A fresh `<run.output_dir>/<run.name>-<time>` (created), suffixed `-2`, `-3`, ... when another
    run started in the same second: a shared directory would resume the other run's checkpoints."""
    base = Path(config.run.output_dir) / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def _check_model_path(config: RunConfig) -> None:
    """Fail before starting anything when model.path names a local directory that is not there."""
    if not isinstance(config.model, HFModelSection):
        return
    path = config.model.path
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") != 1
    if looks_local and not Path(path).expanduser().exists():
        raise SystemExit(f"rlmesh up: model.path={path!r} does not exist; point it at a local HF model directory "
                         "(config.json, weights, tokenizer) or use model.type=tiny")


def _run(mesh: Mesh, config: RunConfig, run_dir: Path,
         on_row: Callable[[dict[str, Any]], None] | None = None) -> int:
    # A run directory used again (`--run-dir`: the learner resumes from its newest checkpoint) holds
    # the earlier processes' rows: only rows written from here on are shown, and the bar follows the
    # version (a resumed learner goes back to its checkpoint's).
    metrics = _Tail(run_dir / "metrics.jsonl", skip_existing=True)

    from rlmesh.services.precision import resolve_precision

    # Measured once here (learner.backend.param_dtype=auto, rollout.dtype=learner), so every tier agrees.
    resolved = resolve_precision(config).model_copy(deep=True)
    mesh.pass_secrets(config, resolved)

    # Model preparation (tiny model, SFT warm start) runs first, beside everything that does not
    # need its result: the reward server, and (with SFT) the rollout servers on the model from
    # before SFT, whose weights the learner replaces with its version 0 before they serve anything.
    prep, placeholder = None, None
    if config.model.type == "tiny" or config.sft.num_steps > 0:
        model_dir = run_dir / "sft_model" if config.sft.num_steps > 0 else run_dir / "init_model"
        cmd = "sft" if config.sft.num_steps > 0 else "tiny-model"
        print(f"rlmesh up: preparing the policy ({cmd} -> {model_dir.name})", flush=True)
        prep = mesh.spawn(cmd, [cmd, "-c", str(run_dir / "config.yaml"), "--output", str(model_dir)])
        resolved.model = HFModelSection(path=str(model_dir))
        if cmd == "sft" and not config.learner.lora.rank:  # an adapter broadcast would leave the base pre-SFT
            # The SFT process writes the tiny initial model there before it trains (renamed into place).
            placeholder = str(run_dir / "init_model") if config.model.type == "tiny" else config.model.path

    learner_port, reward_port = free_port(), free_port()
    host = config.network.host
    resolved.network.learner_address = f"{host}:{learner_port}"
    resolved.network.reward_address = f"{host}:{reward_port}"
    # Serving before the main reward server registers them, so it learns what they serve.
    env_servers = start_env_servers(mesh, config, resolved, run_dir)
    resolved_path = run_dir / "config.resolved.yaml"
    dump_config(resolved, resolved_path)
    base = ["-c", str(resolved_path)]
    mesh.wait_serving(config.network, env_servers)
    mesh.spawn("reward", ["reward", *base, "--port", str(reward_port)])

    def spawn_rollouts(extra: list[str]) -> None:
        for i in range(config.rollout.num_servers):
            mesh.spawn(f"rollout-{i}", ["rollout", *base, "--port", "0", "--generator-id", f"rollout-{i}", *extra])

    # Servers loading a model being written (tiny, or SFT's start) start now: vLLM's import overlaps the writing.
    early = placeholder is not None or (prep is not None and config.sft.num_steps == 0)
    if early:
        spawn_rollouts([*(["--placeholder-model", placeholder] if placeholder else []), "--await-model",
                        str(AWAIT_MODEL_S)])
    if prep is not None:
        _wait_prepared(mesh, prep, config, lambda: prep.proc.poll() == 0, "the policy")
    learner = mesh.spawn("learner", ["learner", *base, "--run-dir", str(run_dir), "--port", str(learner_port)],
                         launcher=torchrun_args(config))
    if not early:
        spawn_rollouts([])

    mesh.wait_serving(config.network, {"reward": reward_port, "learner": learner_port})
    print("rlmesh up: reward and learner serving; rollout servers loading vLLM", flush=True)
    return _watch(mesh, learner, config, run_dir, on_row, metrics)


def _wait_prepared(mesh: Mesh, prep: Service, config: RunConfig, done: Callable[[], bool], what: str) -> None:
    """Wait for the model preparation to get as far as `done` says, supervising the services already
    started meanwhile (restarts; one out of restarts fails the launch, named)."""
    while not done():
        code = prep.proc.poll()
        if code not in (None, 0):
            raise SystemExit(f"rlmesh up: {prep.name} failed (exit {code}); last lines of {prep.log_path}:\n"
                             f"{prep.tail()}")
        if code == 0 and not done():
            raise SystemExit(f"rlmesh up: {prep.name} finished without {what}; see {prep.log_path}")
        bad = _supervise(mesh, None, config.run.max_restarts)
        if bad is not None:
            raise SystemExit(f"rlmesh up: service '{bad.name}' exited with code {bad.proc.returncode} after "
                             f"{bad.restarts} restart(s) while {prep.name} ran (run.max_restarts="
                             f"{config.run.max_restarts}). Last lines of {bad.log_path}:\n{bad.tail()}")
        time.sleep(0.1)


def torchrun_args(config: RunConfig) -> list[str] | None:
    """The learner as a torchrun job when it has more than one rank. torchrun restarts the whole
    job (from the newest checkpoint) when any rank dies, up to `learner.max_restarts` times."""
    if config.learner.num_ranks == 1:
        return None
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.learner.num_ranks}",
            f"--max-restarts={config.learner.max_restarts}", "--monitor-interval=1"]


def _supervise(mesh: Mesh, learner: Service | None, max_restarts: int) -> Service | None:
    """Restart crashed services with backoff; the service that ran out of restarts, if any."""
    now = time.monotonic()
    for svc in mesh.services:
        code = svc.proc.poll()
        if code is None or svc.name in ("sft", "tiny-model") or (svc is learner and code in (0, STALLED_EXIT)):
            continue
        if svc.restart_at is None:
            if svc.restarts >= max_restarts:
                return svc
            delay = RESTART_BACKOFF.delay(svc.restarts)
            svc.restart_at = now + delay
            tqdm_write(f"rlmesh up: service '{svc.name}' exited with code {code}; restarting in {delay:.0f}s "
                       f"(restart {svc.restarts + 1} of {max_restarts}). Last lines of {svc.log_path}:\n"
                       f"{svc.tail(8)}")
        elif now >= svc.restart_at:
            mesh.restart(svc)
    return None


def first_step_summary(row: dict[str, Any]) -> str:
    """What the first step's groups say about the run's footing (`rlmesh check`'s numbers, from the run)."""
    lengths = row.get("completion_tokens") or [0]
    flat = row.get("num_dropped_flat", 0)
    return (f"first step: {row.get('num_groups_with_signal', '?')} of {row.get('num_groups', '?')} trained groups "
            f"carried a reward signal" + (f" ({flat} more dropped with every reward equal)" if flat else "")
            + f"; reward {row.get('reward_mean', 0.0):.3f}; completion tokens mean {sum(lengths) / len(lengths):.0f}, max "
            f"{max(lengths)}; cut at rollout.max_tokens {row.get('share_cut', 0.0):.0%}")


def tqdm_write(text: str) -> None:
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


class _Tail:
    """The rows appended to a JSONL file since the last call (a line being written waits for the next);
    with `skip_existing`, only those appended after this was made (a run directory used again)."""

    def __init__(self, path: Path, skip_existing: bool = False) -> None:
        self.path, self.offset = path, 0
        if skip_existing and path.exists():
            data = path.read_bytes()
            self.offset = data.rfind(b"\n") + 1

    def rows(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # the torn last line of a writer that was killed, joined to the next one's first
        return rows


def _watch(mesh: Mesh, learner: Service, config: RunConfig, run_dir: Path,
           on_row: Callable[[dict[str, Any]], None] | None = None, metrics: _Tail | None = None) -> int:
    from tqdm import tqdm

    from rlmesh.services.progress import progress

    bar = progress(config.learner.num_steps, "GRPO", "step", enabled=config.logging.progress)
    metrics = metrics or _Tail(run_dir / "metrics.jsonl")
    # The learner waits for callbacks to see each step: read often then.
    poll_s = 0.05 if on_row is not None else 1.0
    said_first = False
    while True:
        # Read after checking for the learner's exit, so the rows it wrote last are not missed.
        done = learner.proc.poll() == 0
        if learner.proc.poll() == STALLED_EXIT:  # the learner said why (an alert row, printed below)
            for r in metrics.rows():
                if r.get("kind") == "alert":
                    tqdm.write(f"rlmesh up: {printable(r['message'])}", file=sys.stderr)
            bar.close()
            print(f"\nrlmesh up: the run stopped: it cannot progress (above; the learner's log: "
                  f"{learner.log_path}; every service's: {run_dir / 'logs'})", file=sys.stderr, flush=True)
            return 1
        bad = _supervise(mesh, learner, config.run.max_restarts)
        if bad is not None:
            bar.close()
            print(f"\nrlmesh up: service '{bad.name}' exited with code {bad.proc.returncode} after {bad.restarts} "
                  f"restart(s) (run.max_restarts={config.run.max_restarts}). Last lines of {bad.log_path}:\n"
                  f"{bad.tail()}", file=sys.stderr, flush=True)
            return 1
        for r in metrics.rows():
            if r.get("kind") == "train" and not said_first:
                said_first = True
                tqdm.write(first_step_summary(r))
            if r.get("kind") == "train":
                bar.update(r["version"] - bar.n)
                bar.set_postfix(reward=f"{r['reward_mean']:.3f}", tok_s=f"{r['tokens_per_s']:.0f}",
                                stale=r["staleness_max"])
            elif r.get("kind") == "eval":
                tqdm.write(f"held-out accuracy at version {r['version']}: {r['accuracy']:.3f}")
            elif r.get("kind") == "alert":
                tqdm.write(f"rlmesh up: {printable(r['message'])}", file=sys.stderr)
            if on_row is not None:
                on_row(r)
        if done:
            bar.close()
            summary_path = run_dir / "summary.json"
            summary = json.loads(summary_path.read_text())
            before, after = summary["held_out_accuracy_before"], summary["held_out_accuracy_after"]
            if before is None:
                print(f"\nheld-out accuracy: after {after:.3f} (not evaluated at the start: learner.eval_at_start=false)")
            else:
                # A reward outside [0, 1] (the mean reward stands in where no environment says what is correct) is no share.
                change = (f"{(after - before) * 100:+.1f} points" if 0 <= min(before, after) <= max(before, after) <= 1
                          else f"{after - before:+.3f}")
                print(f"\nheld-out accuracy: before {before:.3f} -> after {after:.3f} ({change})")
            print(f"staleness: max seen {summary['max_staleness_seen']} (bound {summary['max_staleness']}), "
                  f"dropped stale groups: {summary['num_dropped_stale']}")
            same = summary["last_weights_sha256"] == summary["learner_weights_sha256"]
            print(f"weights: {summary['weights_verified_versions']} broadcasts verified by digest; rollout weights "
                  f"{'==' if same else '!='} learner weights ({summary.get('weights_digest_algorithm', 'sha256')} "
                  f"{summary['learner_weights_sha256'][:16]})")
            print(f"reward curve: {run_dir / 'reward_curve.png'}")
            return 0 if same else 1
        time.sleep(poll_s)
