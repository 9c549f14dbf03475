"""`rlmesh learner`: builds the RL learner from the run config — the queues, the trainer (on the
one torch thread), the weight broadcaster, issuer, admission, trajectory reader, evaluator and
metrics writers, handed to the `Controller`, which only drives them; then the control-plane server,
and resume from the newest checkpoint — runs it, and closes it. The one place where the learner
service's parts meet. Ranks other than 0 only build the trainer and follow rank 0's commands."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from rlmesh.learner.rl.admission import Admission
from rlmesh.learner.rl.controller import Components, Controller, require_model_path
from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.rl.evaluator import Evaluator
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.ledger import Ledger
from rlmesh.learner.rl.membership import LearnerService, Membership
from rlmesh.learner.rl.reader import TrajectoryReader, mark_queues
from rlmesh.learner.rl.validation import Bounds
from rlmesh.learner.rl.watch import STALLED_EXIT, RunStalled, StallWatch, failure_limit, zero_signal_limit
from rlmesh.v1 import learner_pb2, learner_pb2_grpc
from rlmesh.services.auth import ANY, Policy, TLSFiles, check_can_serve, load_token
from rlmesh.services.grpc_server import ServerLimits, start_server
from rlmesh.services.queue import connect_queue, run_streams
from rlmesh.services.telemetry import setup_logging

if TYPE_CHECKING:
    from rlmesh.learner.rl.broadcast import TorchRunner
    from rlmesh.learner.trackers.metrics import Tracker
    from rlmesh.services.queue import StreamQueue
    from rlmesh.services.config import RunConfig
    from rlmesh.services.grpc_server import Server

log = logging.getLogger("rlmesh.learner")
SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name
# Under mutual TLS only rollout servers may join, heartbeat and leave; anyone authenticated may ask the status.
POLICY = Policy({"GetStatus": ANY}, default=frozenset({"rollout"}))


def torch_thread() -> TorchRunner:
    """Runs a blocking call on one dedicated thread, off the event loop: all torch work, collectives
    included, happens there, in the order it was asked for."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    async def run(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(executor, partial(fn, *args))

    return run


def sampler_precision_warning(cfg: RunConfig) -> str:
    """Why the sampler may not see the learner's updates, or "": vLLM serving 16-bit weights of a policy the
    learner computes in float32. The served weights are the float32 master weights rounded to 16 bits; an
    update smaller than half a bf16 step (2^-9 of the weight, ~0.2%) rounds back to the weight it was, so the
    sampler stays near the starting policy while the learner's moves. Measured on SmolLM2-135M (lr 1e-5, 16
    steps): 94% of the weights rounded back to their starting value, and the on-policy mismatch grew from 1e-3
    to 4e-2 in 4 steps at lr 2e-5 (docs/real-model.md)."""
    served, computed = cfg.rollout.dtype, cfg.learner.backend.param_dtype
    if cfg.learner.lora.rank or served not in ("bfloat16", "float16") or computed not in ("float32", "auto"):
        return ""
    return (f"rollout.dtype={served} with learner.backend.param_dtype={computed}: vLLM samples from the weights "
            f"rounded to {served}, which small updates do not change, while the learner computes with them "
            f"unrounded; the sampler lags the learner (watch mismatch_kl in metrics.jsonl). Set "
            "learner.backend.param_dtype=bfloat16 with rollout.dtype=bfloat16 (both sides then compute with the same "
            "rounded weights), or rollout.dtype=float32")


async def build_controller(config: RunConfig, run_dir: Path, port: int) -> tuple[Controller, Server]:
    """The controller, resumed from the run's newest checkpoint if there is one, and its running
    control-plane server (port 0: any free port)."""
    from transformers import AutoTokenizer

    from rlmesh.learner.rl.broadcast import WeightBroadcaster, WeightSource
    from rlmesh.learner.trackers.metrics import MetricsWriter
    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.services.weights.announce import UpdateAnnouncer
    from rlmesh.services.weights import build_sender

    cfg = config
    model_path = require_model_path(cfg)
    run_id = f"{cfg.run.name}-{uuid.uuid4().hex[:8]}"
    run_torch = torch_thread()
    token, tls = _credentials(cfg)
    queue = connect_queue(cfg.queue, "learner")
    prompts, trajectories = run_streams(queue, cfg.queue)
    await mark_queues(prompts, trajectories, run_id)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = await run_torch(lambda: Trainer(cfg, model_path, pad_id=tokenizer.pad_token_id))
    cfg = trainer.config  # with the precision resolved (param_dtype=auto, rollout.dtype=learner, lr_bfloat16)
    weights = WeightSource(trainer.weight_metas, trainer.stream_weights)
    membership = Membership(token=token, rpc_timeout_s=cfg.network.rpc_timeout_s, tls=tls)

    train_set, eval_set = load_dataset(cfg.data, cfg.run.seed, cfg.reward)
    # The run's outstanding work: the issuer writes it, everyone else reads it.
    ledger = Ledger(cfg.algorithm.group_size)
    ledger.earlier_run_ids = note_run_id(run_dir, run_id)
    issuer = PromptIssuer(prompts, run_id, train_set, group_size=cfg.algorithm.group_size,
                          groups_per_step=cfg.learner.groups_per_step, max_staleness=cfg.algorithm.max_staleness,
                          ledger=ledger)
    metrics = MetricsWriter(run_dir, trackers=trackers(cfg, run_dir, issuer, prompts, trajectories))
    broadcaster = WeightBroadcaster(membership, cfg.weight_sync, build_sender(cfg.weight_sync), run_torch,
                                    announcer=UpdateAnnouncer(queue), metrics=metrics)
    # Which trajectory groups each version was trained on: the audit trail for exactly-once.
    trained_log = MetricsWriter(run_dir, "trained_groups.jsonl")
    dropped_log = MetricsWriter(run_dir, "dropped_groups.jsonl")
    watch = StallWatch(metrics, failure_limit=failure_limit(cfg.learner),
                       zero_signal_limit=zero_signal_limit(cfg.learner),
                       stop_on_zero_signal=cfg.learner.stall.on_zero_signal == "stop",
                       log_hint=str(run_dir / "logs" / "{service}.log"))
    admission = Admission(trajectories, dropped_log, max_staleness=cfg.algorithm.max_staleness,
                          drop_zero_advantage_groups=cfg.algorithm.drop_zero_advantage_groups,
                          ledger=ledger, bounds=bounds(cfg, model_path), watch=watch)
    reader = TrajectoryReader(prompts, trajectories, run_id=run_id, issuer=issuer, admission=admission,
                              membership=membership, metrics=metrics, watch=watch)
    evaluator = Evaluator(eval_set, issuer, trajectories, metrics, check=admission.check,
                          pass_k=cfg.learner.eval_pass_k, num_samples=cfg.learner.eval_num_samples,
                          samples=MetricsWriter(run_dir, "eval_samples.jsonl") if cfg.logging.eval_samples else None,
                          samples_per_round=cfg.logging.eval_samples)
    controller = Controller(cfg, run_dir, Components(
        run_id=run_id, run_torch=run_torch, prompts=prompts, trajectories=trajectories, trainer=trainer,
        weights=weights, membership=membership, broadcaster=broadcaster, issuer=issuer, admission=admission,
        reader=reader, evaluator=evaluator, metrics=metrics, trained_log=trained_log, dropped_log=dropped_log,
        watch=watch))

    server = await serve_control_plane(cfg, port, LearnerService(membership, run_id, controller.status,
                                                                 lambda: controller.version))
    log.info("learner control plane on port %d (run %s, %d training rank(s))", server.port, run_id, trainer.world_size)
    if (warning := sampler_precision_warning(cfg)):
        log.warning("%s", warning)
    await controller.resume()
    return controller, server


def _credentials(config: RunConfig) -> tuple[str | None, TLSFiles | None]:
    """The learner's token and TLS files, refused here if they cannot serve `network.host` safely."""
    token = load_token(config.network.token_file, config.network.token_env)
    tls = TLSFiles.from_config(config.network, "learner")
    check_can_serve(config.network.host, token=token, tls=tls, insecure=config.network.insecure)
    return token, tls


async def serve_control_plane(config: RunConfig, port: int, service: LearnerService) -> Server:
    """The learner's control-plane server for `service`: its token, TLS, tier policy and limits."""
    token, tls = _credentials(config)
    return await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, service, SERVICE_NAME)],
                              host=config.network.host, port=port, token=token, tls=tls,
                              insecure=config.network.insecure, policy=POLICY,
                              limits=ServerLimits.from_config(config.network, "learner"))


@dataclass
class PartialLearner:
    """A learner without a trainer, for commands that stand in for one (`rlmesh eval`, `rlmesh
    check`): its control plane serving (rollout servers register and heartbeat as with the real
    one; no weights are sent), its queues, and an issuer with its ledger. `server.stop` ends it."""

    run_id: str
    membership: Membership
    server: Server
    prompts: StreamQueue
    trajectories: StreamQueue
    issuer: PromptIssuer


async def partial_learner(config: RunConfig, port: int) -> PartialLearner:
    token, tls = _credentials(config)
    run_id = f"eval-{uuid.uuid4().hex[:8]}"
    prompts, trajectories = run_streams(connect_queue(config.queue, "learner"), config.queue)
    await prompts.ensure_group()
    await trajectories.ensure_group()
    membership = Membership(token=token, rpc_timeout_s=config.network.rpc_timeout_s, tls=tls)
    service = LearnerService(membership, run_id, lambda: learner_pb2.LearnerStatusResponse(run_id=run_id), lambda: 0)
    server = await serve_control_plane(config, port, service)
    issuer = PromptIssuer(prompts, run_id, [], group_size=1, groups_per_step=1, max_staleness=0)
    return PartialLearner(run_id, membership, server, prompts, trajectories, issuer)


def trackers(config: RunConfig, run_dir: Path, issuer: PromptIssuer, prompts: StreamQueue,
             trajectories: StreamQueue) -> list[Tracker]:
    """The experiment trackers `logging.trackers` names, and with `logging.metrics_port` set the
    Prometheus endpoint, fed from the same records plus a poller of the queues."""
    from rlmesh.learner.trackers import build_trackers
    from rlmesh.services.prom import serve_metrics

    out = build_trackers(config.logging, run_dir, run_dir.name, config.model_dump(mode="json"))
    if serve_metrics(config, "learner", run_dir=run_dir) is not None:
        from rlmesh.learner.rl.prom import PrometheusTracker

        prom = PrometheusTracker()
        prom.poll(issuer, {"prompts": prompts, "trajectories": trajectories})  # stopped when the writer closes
        out.append(prom)
    return out


def bounds(config: RunConfig, model_path: str) -> Bounds:
    """What a well-formed trajectory group stays within, for this model and rollout config."""
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(model_path)
    # A multi-turn episode's last environment message may run past the rollout context; the model's
    # positions are the real limit.
    return Bounds(vocab_size=model.vocab_size, max_abs_reward=config.reward.max_abs_reward,
                  max_seq_len=max(config.rollout.max_model_len, getattr(model, "max_position_embeddings", 0)))


def note_run_id(run_dir: Path, run_id: str) -> set[str]:
    """Record this process's run id in the run directory, and return those of earlier processes of
    this run: groups issued under them (before a restart) are still this run's work."""
    path = run_dir / "learner_run_ids.txt"
    earlier = set(path.read_text().split()) if path.exists() else set()
    with path.open("a") as f:
        f.write(run_id + "\n")
    return earlier


async def run(config: RunConfig, args: argparse.Namespace) -> None:
    run_dir = Path(args.run_dir)
    setup_logging("learner", config.logging.level, fmt=config.logging.format,
                  trace_file=config.logging.trace_file,
                  sample_ratio=config.logging.trace_sample_ratio, run_dir=run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    port = args.port if args.port is not None else int(config.network.learner_address.rsplit(":", 1)[1])
    controller, server = await build_controller(config, run_dir, port)
    code = 1
    try:
        summary = await controller.train()
        from rlmesh.learner.trackers.metrics import plot_reward_curve

        if (png := plot_reward_curve(run_dir / "metrics.jsonl", run_dir / "reward_curve.png")) is not None:
            controller.metrics.log_image("reward_curve", png, controller.version)
        log.info("done: %s", json.dumps(summary))
        code = 0
    except RunStalled:
        code = STALLED_EXIT
        raise
    finally:
        await controller._torch(controller.trainer.stop)
        controller.metrics.close()
        controller.trained_log.close()
        controller.dropped_log.close()
        await server.stop(2.0)
        exit_if_held(EXIT_GRACE_S, code)


EXIT_GRACE_S = 30.0


def exit_if_held(grace_s: float, code: int) -> None:
    """Once the run's outputs are written and closed, nothing may keep the learner alive: a thread
    stuck in a transfer to a rollout server that has gone (a gloo call has no cancel) would hold the
    interpreter's exit, which waits for every worker thread, forever (seen once in the compose test:
    "done" logged, the container up minutes later). After `grace_s` the live threads' stacks go to the
    log and the process exits with `code`."""
    import faulthandler
    import threading
    import time

    def watch() -> None:
        time.sleep(grace_s)
        log.error("the run ended %.0f s ago but a thread still holds the process; exiting with %d. Threads:",
                  grace_s, code)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=watch, name="exit-watch", daemon=True).start()


def follow(config: RunConfig) -> None:
    """A training rank other than 0: build the same model, then run rank 0's commands."""
    from transformers import AutoTokenizer

    from rlmesh.learner.train.trainer import Trainer

    setup_logging(f"learner-rank{os.environ.get('RANK')}", config.logging.level, fmt=config.logging.format)
    path = require_model_path(config)
    Trainer(config, path, pad_id=AutoTokenizer.from_pretrained(path).pad_token_id).follow()


def main(config: RunConfig, args: argparse.Namespace) -> int:
    require_model_path(config)
    if int(os.environ.get("RANK", "0")) != 0:
        follow(config)
        return 0
    try:
        uvloop.run(run(config, args))
    except RunStalled as err:  # already in the log and the metrics (an alert row rlmesh up prints)
        print(f"rlmesh learner: {err}", file=sys.stderr, flush=True)
        return STALLED_EXIT
    return 0
