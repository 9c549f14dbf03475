"""`rlmesh learner`: the controller and trainer. Owns setup and the main loop: issue prompt groups
within the staleness bound, consume trajectory groups, train, broadcast weights, checkpoint, ack.

Staleness: at most (max_staleness + 1) * groups_per_step train groups are outstanding (issued and
not yet trained). Generators hold version >= v when they read a group issued at version v (the
broadcast finishes before new groups are issued), so a group is at most `max_staleness` versions
old when trained; anything that still arrives older (overtaken by later groups) is dropped and
counted."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import uvloop
from google.protobuf.message import DecodeError
from google.protobuf.struct_pb2 import Struct

from learner.data import Example, load_dataset
from learner.membership import LearnerService, Membership
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc
from services.auth import TLSFiles, load_token
from services.config import HFModelSection, RunConfig
from services.grpc_server import start_server
from services.queue import Entry, StreamQueue, connect
from services.telemetry import setup_logging

log = logging.getLogger("rlmesh.learner")
SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name
CONSUMER = "learner"


class Learner:
    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        if not isinstance(config.model, HFModelSection):
            raise ValueError("the learner needs model.type=hf with model.path; `rlmesh up` prepares the model")
        self.config, self.run_dir = config, run_dir
        self.run_id = f"{config.run.name}-{uuid.uuid4().hex[:8]}"
        self.version = 0
        self.k = config.algorithm.max_staleness
        self.B = config.learner.groups_per_step
        self.in_flight = 0
        self.num_issued = 0
        self.num_dropped_stale = 0
        self.num_dropped_other = 0
        self.num_duplicates = 0
        self.trained_groups: set[str] = set()
        self.unacked: list[str] = []  # trajectory entries trained on, acked after the next checkpoint
        # Train groups read while evaluating, not yet accepted into the buffer.
        self.held_back: list[tuple[Entry, common_pb2.TrajectoryGroup]] = []
        self.max_staleness_seen = 0
        self.resumed_from: int | None = None
        self._last_arrival = self._last_wait_log = time.monotonic()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self._train_cursor = 0

    async def _torch(self, fn, *args):
        """All torch work runs on one thread, off the event loop (gRPC stays responsive)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(fn, *args))

    # --- setup ---------------------------------------------------------------------------------

    async def setup(self, port: int) -> None:
        import torch
        from transformers import AutoTokenizer

        from learner.algorithms.loss import LossConfig
        from learner.backends.fsdp2 import FSDP2Backend
        from learner.broadcast import WeightBroadcaster
        from learner.metrics import MetricsWriter

        cfg = self.config
        token = load_token(cfg.network.token_file, cfg.network.token_env)
        self.membership = Membership(token=token, rpc_timeout_s=cfg.network.rpc_timeout_s)
        service = LearnerService(self.membership, self.run_id, self.status, lambda: self.version)
        self.server = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, service, SERVICE_NAME)],
                                         host=cfg.network.host, port=port, token=token, tls=TLSFiles.from_env())
        log.info("learner control plane on port %d (run %s)", self.server.port, self.run_id)

        redis = connect(cfg.queue.url)
        self.prompts = StreamQueue(redis, cfg.queue.prompt_stream, group="rollout", max_len=cfg.queue.max_len,
                                   claim_idle_ms=cfg.queue.claim_idle_ms)
        self.trajectories = StreamQueue(redis, cfg.queue.trajectory_stream, group="learner",
                                        max_len=cfg.queue.max_len, claim_idle_ms=cfg.queue.claim_idle_ms)
        await self.prompts.ensure_group()
        await self.trajectories.ensure_group()

        torch.set_num_threads(cfg.learner.torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.backend = await self._torch(lambda: FSDP2Backend(
            cfg.model.path, lr=cfg.learner.lr, weight_decay=cfg.learner.weight_decay,
            max_grad_norm=cfg.learner.max_grad_norm, param_dtype=cfg.learner.backend.param_dtype, seed=cfg.run.seed))
        self.loss_cfg = LossConfig(cfg.algorithm.name, cfg.algorithm.clip_low, cfg.algorithm.clip_high,
                                   cfg.algorithm.tis_cap, cfg.rollout.max_tokens)
        self.broadcaster = WeightBroadcaster(self.membership, cfg.weight_sync)
        self.train_set, self.eval_set = load_dataset(cfg.data, cfg.run.seed)
        self.metrics = MetricsWriter(self.run_dir)
        # Which trajectory groups each version was trained on: the audit trail for exactly-once.
        self.trained_log = MetricsWriter(self.run_dir, "trained_groups.jsonl")
        self.dropped_log = MetricsWriter(self.run_dir, "dropped_groups.jsonl")
        await self._resume()

    async def _resume(self) -> None:
        """Continue from the newest durable checkpoint, if any: restore weights, optimizer, version
        and the trained group ids, then replay this consumer's unacked trajectories (trained after
        that checkpoint, or never trained) through the normal accept path."""
        import torch

        from learner.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            return
        state = await self._torch(lambda: torch.load(ckpt / "trainer_state.pt", weights_only=False))
        await self._torch(self.backend.load_checkpoint_state, state["backend"])
        self.version = int(state["version"])
        self.trained_groups = set(state["trained_groups"])
        self._train_cursor = int(state.get("train_cursor", 0))
        # Prompts issued before the restart still come back as trajectories: count them in flight.
        self.in_flight = (await self.prompts.depth()).length + (await self.trajectories.depth()).lag
        replay = await self.trajectories.read_own_pending(CONSUMER, count=100000)
        for entry in replay:
            try:
                self.held_back.append((entry, common_pb2.TrajectoryGroup.FromString(entry.data)))
            except DecodeError:
                await self.trajectories.ack(entry.id)
        self.resumed_from = self.version
        log.info("resumed from %s at version %d: %d trained groups on record, %d unacked trajectories to "
                 "replay, ~%d groups in flight", ckpt.name, self.version, len(self.trained_groups), len(replay),
                 self.in_flight)

    async def sync_generators(self) -> None:
        """Bring generators that hold other weights (late joiners, survivors of a learner restart)
        to the current version now, rather than after the next step: they serve nothing until then."""
        if self.membership.out_of_date(self.version):
            await self.broadcaster.broadcast(self.version, lambda: list(self.backend.full_weights()))

    def status(self) -> learner_pb2.LearnerStatusResponse:
        now = time.monotonic()
        return learner_pb2.LearnerStatusResponse(
            run_id=self.run_id, version=self.version, step=self.version, num_inflight_groups=self.in_flight,
            num_dropped_stale=self.num_dropped_stale,
            generators=[learner_pb2.GeneratorInfo(generator_id=g.generator_id, address=g.address, version=g.version,
                                                  in_group=g.in_group, seconds_since_heartbeat=now - g.last_seen)
                        for g in self.membership.generators.values()])

    # --- prompts ---------------------------------------------------------------------------------

    def _prompt_group(self, ex: Example, split: str, n: int, greedy: bool) -> common_pb2.PromptGroup:
        self.num_issued += 1
        metadata = Struct()
        metadata.update({"answer": ex.answer})
        group = common_pb2.PromptGroup(
            group_id=f"{self.run_id}/{split}/{self.num_issued}/{ex.id}", run_id=self.run_id,
            messages=[common_pb2.ChatMessage(role="user", content=ex.prompt)], env_name=ex.env,
            env_metadata=metadata, n=n, issued_at_version=self.version, split=split)
        if greedy:
            group.sampling.temperature = 0.0
        return group

    async def issue_train_prompts(self, num_buffered: int) -> None:
        budget = (self.k + 1) * self.B - self.in_flight - num_buffered
        for _ in range(max(budget, 0)):
            ex = self.train_set[self._train_cursor % len(self.train_set)]
            self._train_cursor += 1
            group = self._prompt_group(ex, "train", self.config.algorithm.group_size, greedy=False)
            await self.prompts.publish(group.group_id, group.SerializeToString())
            self.in_flight += 1

    # --- consuming -------------------------------------------------------------------------------

    async def _read(self) -> list[tuple[Entry, common_pb2.TrajectoryGroup]]:
        entries = await self.trajectories.read(CONSUMER, count=256, block_ms=500)
        now = time.monotonic()
        if entries:
            self._last_arrival = now
        elif now - self._last_arrival > 30 and now - self._last_wait_log > 30:
            self._last_wait_log = now
            depth = await self.prompts.depth()
            gens = ", ".join(f"{g.generator_id}@v{g.version}" for g in self.membership.generators.values()) or "none"
            log.warning("no trajectories for %.0fs: %d groups in flight, prompt stream %d unacked (%d undelivered), "
                        "generators: %s", now - self._last_arrival, self.in_flight, depth.length, depth.lag, gens)
        out = []
        for entry in entries:
            try:
                out.append((entry, common_pb2.TrajectoryGroup.FromString(entry.data)))
            except DecodeError as err:
                log.error("trajectory entry %s is not a TrajectoryGroup (%s); dropped", entry.id, err)
                self.num_dropped_other += 1
                await self.trajectories.ack(entry.id)
        return out

    def _staleness(self, group: common_pb2.TrajectoryGroup) -> int:
        return self.version - min((s.min_version for s in group.samples), default=self.version)

    async def _drop_if_stale(self, entry: Entry, group: common_pb2.TrajectoryGroup) -> bool:
        if self._staleness(group) <= self.k:
            return False
        self.num_dropped_stale += 1
        reason = f"staleness {self._staleness(group)} > max_staleness {self.k}"
        log.info("group %s dropped: %s", group.group_id, reason)
        self.dropped_log.write({"version": self.version, "group_id": group.group_id, "reason": reason})
        await self.trajectories.ack(entry.id)
        return True

    async def _accept(self, entry: Entry, group: common_pb2.TrajectoryGroup) -> bool:
        """True if a newly arrived group goes into the training buffer; otherwise it is acked and
        counted (never trained on)."""
        if group.group_id in self.trained_groups:
            self.num_duplicates += 1
            await self.trajectories.ack(entry.id)
            return False
        self.in_flight = max(self.in_flight - 1, 0)
        if await self._drop_if_stale(entry, group):
            return False
        reason = ""
        valid = [s for s in group.samples if not s.error]
        if max((max(s.min_version, s.max_version) for s in group.samples), default=0) > self.version:
            self.num_dropped_other += 1
            reason = "generated by weights newer than the learner's (lost in a learner restart)"
        elif len(valid) < 2:
            self.num_dropped_other += 1
            errors = {s.error for s in group.samples if s.error}
            reason = f"{len(valid)} valid samples (errors: {'; '.join(sorted(errors))[:300]})"
        elif self.config.algorithm.drop_zero_advantage_groups and len({s.reward for s in valid}) == 1:
            self.num_dropped_other += 1
            reason = "all rewards equal (dynamic sampling)"
        if reason:
            log.debug("group %s dropped: %s", group.group_id, reason)
            self.dropped_log.write({"version": self.version, "group_id": group.group_id, "reason": reason})
            await self.trajectories.ack(entry.id)
            return False
        return True

    def _sequences(self, groups: list[common_pb2.TrajectoryGroup]):
        import torch

        from learner.algorithms.advantages import group_advantages
        from learner.batch import Sequence

        seqs = []
        for g in groups:
            valid = [s for s in g.samples if not s.error]
            adv = group_advantages(torch.tensor([s.reward for s in valid]), self.config.algorithm.name)
            for s, a in zip(valid, adv.tolist()):
                seqs.append(Sequence(list(g.prompt_token_ids), list(s.completion.token_ids), list(s.completion.loss_mask),
                                     list(s.logprobs), a, g.group_id))
        return seqs

    def _train_step(self, groups: list[common_pb2.TrajectoryGroup]) -> dict[str, float]:
        from learner.algorithms.loss import policy_loss
        from learner.batch import split_micro_batches

        temperature = self.config.rollout.temperature
        micros = split_micro_batches(self._sequences(groups), self.config.learner.micro_batch_size,
                                     self.tokenizer.pad_token_id)
        for m in micros:
            m.old_logprobs_BT = self.backend.compute_logprobs(m, temperature)
        lr = self.learning_rate()
        self.backend.set_lr(lr)
        return {**self.backend.train_step(micros, partial(policy_loss, cfg=self.loss_cfg), temperature), "lr": lr}

    def learning_rate(self) -> float:
        """The schedule's rate for the step that takes version `self.version` to the next."""
        cfg = self.config.learner
        if cfg.lr_schedule == "constant":
            return cfg.lr
        progress = self.version / max(cfg.num_steps - 1, 1)
        return cfg.lr * (1 - (1 - cfg.lr_final_ratio) * min(progress, 1.0))

    # --- eval ------------------------------------------------------------------------------------

    async def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out set, generated by the rollout tier with current weights.
        Train groups that arrive meanwhile are held back for the training loop."""
        pending = set()
        for ex in self.eval_set:
            group = self._prompt_group(ex, "eval", 1, greedy=True)
            await self.prompts.publish(group.group_id, group.SerializeToString())
            pending.add(group.group_id)
        t0, results = time.monotonic(), []
        while pending:
            await self.sync_generators()
            for entry, group in await self._read():
                if group.group_id in pending:
                    pending.discard(group.group_id)
                    results.append(group.samples[0])
                    await self.trajectories.ack(entry.id)
                elif group.prompt.split == "train":
                    self.held_back.append((entry, group))
                else:  # an eval group of an earlier round (e.g. before a restart)
                    await self.trajectories.ack(entry.id)
            if time.monotonic() - t0 > 600:
                raise TimeoutError(f"{len(pending)} eval groups not back after 600s; is a rollout server running?")
        accuracy = sum(s.reward for s in results) / max(len(results), 1)
        record = {"kind": "eval", "version": self.version, "accuracy": accuracy, "num_prompts": len(results),
                  "num_errors": sum(1 for s in results if s.error), "eval_s": time.monotonic() - t0}
        self.metrics.write(record)
        log.info("held-out accuracy at version %d: %.3f (%d prompts)", self.version, accuracy, len(results))
        return record

    # --- main loop -------------------------------------------------------------------------------

    async def _checkpoint(self) -> Path:
        from learner.checkpoint import save_checkpoint

        state = {"version": self.version, "trained_groups": sorted(self.trained_groups), "run_id": self.run_id,
                 "train_cursor": self._train_cursor}
        path = await self._torch(save_checkpoint, self.run_dir / "checkpoints", self.version, self.backend,
                                 self.tokenizer, state, self.config.checkpoint.keep_last)
        # Only now is the training on these trajectories durable: ack them.
        acked = await self.trajectories.ack(*self.unacked)
        log.info("checkpoint %s written; acked %d trajectory groups", path.name, acked)
        self.unacked = []
        return path

    async def wait_for_generators(self) -> None:
        want, t0, last = self.config.learner.min_generators, time.monotonic(), 0.0
        while len(self.membership.generators) < want:
            if time.monotonic() - last > 10:
                log.info("waiting for %d rollout server(s) to register (have %d, %.0fs)", want,
                         len(self.membership.generators), time.monotonic() - t0)
                last = time.monotonic()
            await asyncio.sleep(0.5)
        await self.sync_generators()

    async def train(self) -> dict:
        cfg = self.config
        await self.wait_for_generators()
        before = await self.evaluate()
        ready: list[tuple[Entry, common_pb2.TrajectoryGroup]] = []
        t_last = time.monotonic()
        while self.version < cfg.learner.num_steps:
            # Leftovers from the last step are one version older now: re-check them.
            ready = [(e, g) for e, g in ready if not await self._drop_if_stale(e, g)]
            arrivals, self.held_back = self.held_back, []
            while len(ready) < self.B:
                for e, g in arrivals:
                    if g.prompt.split != "train":
                        await self.trajectories.ack(e.id)
                    elif await self._accept(e, g):
                        ready.append((e, g))
                if len(ready) >= self.B:
                    break
                await self.issue_train_prompts(len(ready))
                await self.sync_generators()
                arrivals = await self._read()
            # Oldest first: leftovers are the freshest groups, so fewer of them age past the bound.
            ready.sort(key=lambda eg: self._staleness(eg[1]), reverse=True)
            batch, ready = ready[: self.B], ready[self.B :]
            groups = [g for _, g in batch]
            staleness = [self.version - min(s.min_version for s in g.samples) for g in groups]
            self.max_staleness_seen = max(self.max_staleness_seen, max(staleness))
            t_step = time.monotonic()
            train_metrics = await self._torch(self._train_step, groups)
            train_s = time.monotonic() - t_step
            self.version += 1
            for e, g in batch:
                self.trained_groups.add(g.group_id)
                self.unacked.append(e.id)
            self.trained_log.write({"version": self.version, "group_ids": [g.group_id for g in groups]})
            bc = await self.broadcaster.broadcast(self.version, lambda: list(self.backend.full_weights()))
            samples = [s for g in groups for s in g.samples if not s.error]
            num_tokens = sum(len(s.completion.token_ids) for s in samples)
            now = time.monotonic()
            depth = await self.prompts.depth()
            record = {
                "kind": "train", "version": self.version, "reward_mean": sum(s.reward for s in samples) / len(samples),
                "num_groups": len(groups), "num_samples": len(samples), "num_tokens": num_tokens,
                "tokens_per_s": num_tokens / max(now - t_last, 1e-6), "step_s": now - t_last, "train_s": train_s,
                "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                "max_staleness": self.k, "num_dropped_stale": self.num_dropped_stale,
                "num_dropped_other": self.num_dropped_other, "num_duplicates": self.num_duplicates,
                "prompt_queue_length": depth.length, "in_flight": self.in_flight, **train_metrics, **bc,
                "groups_by_generator": dict(Counter(g.generator_id for g in groups)),
            }
            self.metrics.write(record)
            t_last = now
            log.info("step %d reward %.3f staleness<=%d mismatch_kl %.2e %.0f tok/s", self.version,
                     record["reward_mean"], record["staleness_max"], record.get("mismatch_kl", 0.0), record["tokens_per_s"])
            every = cfg.checkpoint.every_n_steps
            if every and self.version % every == 0 and self.version < cfg.learner.num_steps:
                await self._checkpoint()
            if cfg.learner.eval_every and self.version % cfg.learner.eval_every == 0 and self.version < cfg.learner.num_steps:
                await self.evaluate()
        after = await self.evaluate()
        checkpoint = await self._checkpoint()
        # Groups still in flight when training ends were never trained on; leave them pending.
        summary = {
            "run_id": self.run_id, "num_steps": self.version, "max_staleness": self.k, "resumed_from": self.resumed_from,
            "held_out_accuracy_before": before["accuracy"], "held_out_accuracy_after": after["accuracy"],
            "max_staleness_seen": self.max_staleness_seen, "num_dropped_stale": self.num_dropped_stale,
            "num_dropped_other": self.num_dropped_other, "num_duplicates": self.num_duplicates,
            "weights_verified_versions": len(self.broadcaster.verified_versions),
            "last_weights_sha256": self.broadcaster.last_digest,
            "learner_weights_sha256": await self._torch(self._weights_digest),
            "checkpoint": str(checkpoint),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _weights_digest(self) -> str:
        """The learner's own weights hashed exactly as the broadcast hashes what it sends."""
        from services.weight_sync import weights_digest

        return weights_digest(list(self.backend.full_weights()))


async def run(config: RunConfig, args: argparse.Namespace) -> None:
    setup_logging("learner", config.logging.level)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    port = args.port if args.port is not None else int(config.network.learner_address.rsplit(":", 1)[1])
    learner = Learner(config, run_dir)
    await learner.setup(port)
    try:
        summary = await learner.train()
        from learner.metrics import plot_reward_curve

        plot_reward_curve(run_dir / "metrics.jsonl", run_dir / "reward_curve.png")
        log.info("done: %s", json.dumps(summary))
    finally:
        learner.metrics.close()
        learner.trained_log.close()
        learner.dropped_log.close()
        await learner.server.stop(2.0)


def main(config: RunConfig, args: argparse.Namespace) -> int:
    uvloop.run(run(config, args))
    return 0
