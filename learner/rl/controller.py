"""The learner's controller. Owns resume and the main loop on rank 0 — issue prompt groups
within the staleness bound, admit trajectory groups, train, broadcast weights, evaluate,
checkpoint, ack — driving components it is given (`rlmesh.learner.rl.server` builds and wires them,
and runs the `rlmesh learner` process; none of them imports this module). Other ranks only follow
rank 0's training commands (`rlmesh.learner.train.trainer`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlmesh.learner.rl.admission import Admission, staleness
from rlmesh.learner.rl.evaluator import Evaluator, Round
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.membership import Membership
from rlmesh.learner.rl.step_record import groups_record
from rlmesh.learner.rl.stop import stop_requested, wait_until_seen
from rlmesh.learner.train.schedule import learning_rate
from rlmesh.v1 import common_pb2, learner_pb2
from rlmesh.services.config import HFModelSection, RunConfig
from rlmesh.services.telemetry import record_span

if TYPE_CHECKING:
    from rlmesh.learner.rl.broadcast import TorchRunner, WeightBroadcaster, WeightSource
    from rlmesh.learner.trackers.metrics import MetricsWriter
    from rlmesh.learner.rl.reader import Arrivals, TrajectoryReader
    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.learner.rl.watch import StallWatch
    from rlmesh.services.queue import StreamQueue

log = logging.getLogger("rlmesh.learner")


def require_model_path(config: RunConfig) -> str:
    if not isinstance(config.model, HFModelSection):
        raise ValueError("the learner needs model.type=hf with model.path; `rlmesh up` prepares the model")
    return config.model.path


@dataclass
class Components:
    """What the controller drives; `rlmesh.learner.rl.server.build_controller` builds them."""

    run_id: str
    run_torch: TorchRunner
    """Runs a blocking call on the one torch thread (all collectives happen there)."""
    prompts: StreamQueue
    trajectories: StreamQueue
    trainer: Trainer
    weights: WeightSource
    membership: Membership
    broadcaster: WeightBroadcaster
    issuer: PromptIssuer
    admission: Admission
    reader: TrajectoryReader
    evaluator: Evaluator
    metrics: MetricsWriter
    trained_log: MetricsWriter
    """Which trajectory groups each version was trained on: the audit trail for exactly-once."""
    dropped_log: MetricsWriter
    watch: StallWatch
    """Says on the console what keeps the run from progressing, and stops it when nothing can."""


class Controller:
    def __init__(self, config: RunConfig, run_dir: Path, parts: Components) -> None:
        self.model_path = require_model_path(config)
        self.config, self.run_dir = config, run_dir
        self.run_id, self._torch = parts.run_id, parts.run_torch
        self.prompts, self.trajectories, self.reader = parts.prompts, parts.trajectories, parts.reader
        self.trainer, self.weights = parts.trainer, parts.weights
        self.membership, self.broadcaster = parts.membership, parts.broadcaster
        self.issuer, self.admission, self.evaluator = parts.issuer, parts.admission, parts.evaluator
        self.metrics, self.trained_log, self.dropped_log = parts.metrics, parts.trained_log, parts.dropped_log
        self.watch = parts.watch
        self.version = 0
        self.k = config.algorithm.max_staleness
        self.B = config.learner.groups_per_step
        self.unacked: list[str] = []  # trajectory entries trained on, acked after the next checkpoint
        # Train groups read while evaluating, not yet admitted into the buffer.
        self.held_back: Arrivals = []
        self.max_staleness_seen = 0
        self.first_due = False  # the first evaluation waits for the first step's groups (train)
        self.resumed_from: int | None = None
        # The prompt top-up after a broadcast, running beside what follows (the next step's training);
        # awaited before anything else issues, checkpoints or evaluates.
        self.issuing: asyncio.Future | None = None
        # learner.train_on_arrival (`Trainer.streams`): the next step's groups already sent to the torch
        # thread to train (in admission order), and those calls; the optimizer step (`Trainer.finish`) follows them.
        self.parts: Arrivals = []
        self.part_calls: list[asyncio.Future] = []

    async def _topped_up(self) -> None:
        """Wait for the background prompt top-up, if any (before issuing more: its budget is fixed)."""
        issuing, self.issuing = self.issuing, None
        if issuing is not None:
            await issuing

    async def _issued(self) -> None:
        """Wait for the background prompt top-up, if any, and for the last weight update to have
        completed on every rollout server (their failures are raised here)."""
        await self._topped_up()
        await self.broadcaster.settled()

    async def _top_up(self, num_buffered: int, version: int) -> None:
        """Issue train prompts at `version` as soon as it is sent: a rollout server that claims one
        before it holds `version` waits for its own update to finish before generating
        (`rlmesh.rollout_server.worker`), so the slowest server's report no longer holds back every
        server's next prompts. The update's completion runs beside the next training step."""
        await self.issuer.issue_train(num_buffered, version)

    async def _refill(self, num_ready: int) -> None:
        """During a step, groups were dropped: issue prompts in their place at this version, counting
        the step's own batch as still buffered (so the bound is the one the last top-up kept). Not
        before that top-up has run (the budget it fixed would be counted twice). Synchronous
        runs (k=0) issue nothing here: the next fill does; nor does the last step (nothing trains after it)."""
        if self.version + 1 < self.config.learner.num_steps and (self.issuing is None or self.issuing.done()):
            await self.issuer.issue_train(num_ready + self.B, self.version)

    async def resume(self) -> None:
        """Continue from the newest durable checkpoint, if any: restore weights, optimizer, RNG,
        version, data cursor and the trained group ids, then replay this consumer's unacked
        trajectories (trained after that checkpoint, or never trained) through admission."""
        from rlmesh.learner.train.checkpoint import latest_checkpoint, load_trainer_state

        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            if self.trained_log.path.stat().st_size:  # an earlier process trained without checkpointing
                self.trained_log.write({"resumed_from": 0, "checkpoint": None})
            return
        state = load_trainer_state(ckpt)
        await self._torch(self.trainer.load, ckpt)
        self.version = int(state["version"])
        self.admission.trained_groups = set(state["trained_groups"])
        self.evaluator.first = state.get("first_eval")
        for name, value in state.get("counters", {}).items():
            setattr(self.admission, name, value)
        # Prompts issued before the restart still come back as trajectories: count them in flight.
        self.issuer.cursor = int(state.get("train_cursor", 0))
        self.issuer.ledger.resume((await self.prompts.depth()).length + (await self.trajectories.depth()).lag)
        replay = await self.reader.replay_pending()
        self.held_back.extend(replay)
        self.resumed_from = self.version
        # Rows of later versions written before the crash are superseded from here on.
        self.trained_log.write({"resumed_from": self.version, "checkpoint": ckpt.name})
        log.info("resumed from %s at version %d: %d trained groups on record, %d unacked trajectories to "
                 "replay, ~%d groups in flight", ckpt.name, self.version, len(self.admission.trained_groups),
                 len(replay), self.issuer.ledger.in_flight)

    def status(self) -> learner_pb2.LearnerStatusResponse:
        now = time.monotonic()
        return learner_pb2.LearnerStatusResponse(
            run_id=self.run_id, version=self.version, step=self.version, num_inflight_groups=self.issuer.ledger.in_flight,
            num_dropped_stale=self.admission.num_dropped_stale,
            generators=[learner_pb2.GeneratorInfo(generator_id=g.generator_id, address=g.address, version=g.version,
                                                  in_group=g.in_group, seconds_since_heartbeat=now - g.last_seen)
                        for g in self.membership.generators.values()])

    async def evaluate(self) -> dict:
        """Evaluate the current version and wait for it (and for rounds still open)."""
        await self._issued()
        return await self.evaluator.run(self.version, self.held_back, self._read)

    # --- main loop -------------------------------------------------------------------------------

    async def _checkpoint(self) -> Path:
        from rlmesh.learner.train.checkpoint import save_checkpoint

        await self._issued()  # the data cursor saved below covers only groups on the stream
        a = self.admission
        lr = self.config.learner
        state = {"trained_groups": sorted(a.trained_groups), "run_id": self.run_id, "train_cursor": self.issuer.cursor,
                 "lr_schedule": {"kind": lr.lr_schedule, "next_lr": learning_rate(lr, self.version)},
                 "first_eval": self.evaluator.first,
                 "counters": a.counters()}
        path = await self._torch(save_checkpoint, self.run_dir / "checkpoints", self.version, self.trainer,
                                 self.model_path, state, self.config.checkpoint.keep_last,
                                 self.config.checkpoint.hf_model)
        # Only now is the training on these trajectories durable: ack them.
        acked = await self.trajectories.ack(*self.unacked)
        log.info("checkpoint %s written; acked %d trajectory groups", path.name, acked)
        self.unacked = []
        return path

    async def wait_for_generators(self) -> None:
        want, t0, last, said = self.config.learner.min_generators, time.monotonic(), 0.0, 0.0
        while len(self.membership.generators) < want:
            waited = time.monotonic() - t0
            if time.monotonic() - last > 10:
                log.info("waiting for %d rollout server(s) to register (have %d, %.0fs)", want,
                         len(self.membership.generators), waited)
                last = time.monotonic()
            if waited - said > 60:  # on the console too, once a minute
                said = waited
                self.watch.alert(f"waiting {waited:.0f}s for {want} rollout server(s) to register (have "
                                 f"{len(self.membership.generators)}): vLLM is still loading, or a server cannot "
                                 "reach the learner; see logs/rollout-*.log")
            await asyncio.sleep(0.5)
        await self.broadcaster.catch_up(self.version, self.weights)

    async def _read(self, version: int) -> Arrivals:
        """What arrived (`TrajectoryReader.read`), once rollout servers that hold other weights are
        brought to `version` (they serve nothing until then)."""
        await self.broadcaster.catch_up(version, self.weights)
        return await self.reader.read(version)

    async def _fill(self, ready: Arrivals) -> Arrivals:
        """Admit arrivals until a step's worth of groups is ready, issuing prompts as room frees.
        Groups held back during an evaluation are admitted first, whatever `ready` already holds."""
        arrivals, self.held_back = self.held_back, []
        while True:
            for e, g in arrivals:
                if g.prompt.split != "train":
                    await self.evaluator.offer(e, g, self.version)  # a round running beside training, or a stray
                elif await self.admission.accept(e, g, self.version):
                    ready.append((e, g))
            self._train_arrived(ready)
            if len(ready) >= self.B:
                return ready
            await self._topped_up()  # not the update's completion: a server generates once it holds the version
            await self._reissue_malformed()
            await self.issuer.issue_train(len(ready), self.version, steps=1 if self.first_due else None)
            arrivals = await self._read(self.version)

    def _train_arrived(self, ready: Arrivals) -> None:
        """learner.train_on_arrival: send the step's groups admitted since the last call (up to
        groups_per_step in all) to the torch thread to train now, beside the generation of the rest;
        the calls queue there in order, and the step's optimizer step after them."""
        if not self.trainer.streams:
            return
        for call in self.part_calls:  # a part that failed stops the run now, not once the batch is in
            if call.done() and call.exception() is not None:
                raise call.exception()
        new = ready[len(self.parts) : self.B]
        if new:
            self.parts.extend(new)
            seqs = self.trainer.objective.sequences([g for _, g in new])
            self.part_calls.append(asyncio.ensure_future(self._torch(self.trainer.accumulate, seqs)))

    async def _reissue_malformed(self) -> None:
        """Issue again, under a fresh id, each train group whose copies all came back malformed for
        learner.reissue_malformed_after_s; the old id is retired (a late copy of it is not trained)."""
        for group_id in self.admission.overdue(self.config.learner.reissue_malformed_after_s):
            new_id = await self.issuer.reissue(group_id, self.version)
            self.admission.retire(group_id, new_id)
            log.warning("group %s: no well-formed copy %.0fs after a malformed one; %s", group_id,
                        self.config.learner.reissue_malformed_after_s,
                        f"issued again as {new_id}" if new_id else "retired (an earlier process issued it)")

    async def train(self) -> dict:
        cfg = self.config
        await self.wait_for_generators()
        first: Round | None = None
        before: dict | None = None  # the starting policy's evaluation (learner.eval_at_start)
        # eval_overlap: the first evaluation goes out once the first step's groups are in (below).
        self.first_due = cfg.learner.eval_at_start and cfg.learner.eval_overlap
        if cfg.learner.eval_at_start and not cfg.learner.eval_overlap:
            before = await self.evaluate()
        ready: Arrivals = []
        t_last = time.monotonic()
        while self.version < cfg.learner.num_steps:
            # Leftovers from the last step are one version older now: re-check them.
            ready = [(e, g) for e, g in ready if not await self.admission.drop_if_stale(e, g, self.version)]
            ready = await self._fill(ready)
            if self.first_due:
                first = await self._start_first_evaluation(len(ready))
            # rlmesh.train's callbacks, when attached, have seen the last step before the next one
            # starts; a stop request they made ends the run at that step.
            await wait_until_seen(self.run_dir, self.version)
            if (reason := stop_requested(self.run_dir)) is not None:
                log.info("stop requested (%s): ending the run at version %d", reason, self.version)
                break
            if not self.trainer.streams:
                # Oldest first: leftovers are the freshest groups, so fewer of them age past the bound.
                ready.sort(key=lambda eg: staleness(eg[1], self.version), reverse=True)
            batch, ready = ready[: self.B], ready[self.B :]  # streaming: the groups already training, in order
            groups = [g for _, g in batch]
            ages = [staleness(g, self.version) for g in groups]
            self.max_staleness_seen = max(self.max_staleness_seen, max(ages))
            t_step = time.monotonic()
            step = asyncio.ensure_future(self._timed_step(groups, learning_rate(cfg.learner, self.version)))
            # While the torch thread trains, the event loop decodes and validates what arrives (and
            # the prompt top-up started after the last broadcast runs): off the step's critical path.
            await self.reader.admit_during(step, self.version, ready, self.held_back, refill=self._refill)
            train_metrics, t_trained = await step
            # When the optimizer step ended (wall clock), and what followed it before the weights went out.
            times = {"train_s": t_trained - t_step, "trained_time": time.time() - (time.monotonic() - t_trained)}
            if first is not None and first.record is None:
                await self.evaluator.finish(self.version, self.held_back, self._read, first)
                times["first_eval_wait_s"] = time.monotonic() - t_trained
            self.version += 1
            end_ns = time.time_ns()
            for g in groups:  # each group's trace ends with the step that trained it
                record_span("train", g.group_id, g.trace_context, end_ns - int(times["train_s"] * 1e9), end_ns,
                            version=self.version, staleness=staleness(g, self.version - 1))
            for e, g in batch:
                self.admission.trained(g.group_id)
                self.unacked.append(e.id)
            self.trained_log.write({"version": self.version, "group_ids": [g.group_id for g in groups]})
            # Returns once the weights are sent; every server's reply and the digest check complete
            # beside the next step (`broadcaster.settled`; checkpoints and evaluations wait for it).
            bc = await self.broadcaster.send(self.version, self.weights)
            # Top the prompt stream up as soon as the new version is out, whatever comes next: a
            # step trained from groups already buffered (e.g. those held back during an evaluation)
            # would otherwise leave the rollout tier idle, and a checkpoint or evaluation would too.
            # It runs in the background (a thousand groups take seconds to build and send): the
            # budget is fixed when it starts, and whatever issues next waits for it first.
            if self.version < cfg.learner.num_steps:
                self.issuing = asyncio.ensure_future(self._top_up(len(ready), self.version))
            self._log_step(groups, ages, {**train_metrics, **bc, **times}, t_last)
            t_last = time.monotonic()
            every = cfg.checkpoint.every_n_steps
            if every and self.version % every == 0 and self.version < cfg.learner.num_steps:
                await self._checkpoint()
            if cfg.learner.eval_every and self.version % cfg.learner.eval_every == 0 and self.version < cfg.learner.num_steps:
                if cfg.learner.eval_overlap:
                    await self._issued()  # every rollout server holds this version before its eval prompts go out
                    await self.evaluator.start(self.version)  # finishes as its groups come back
                else:
                    await self.evaluate()
        after = await self.evaluate()  # also completes the first round, where no step ran
        if first is not None:
            before = first.record
        checkpoint = await self._checkpoint()
        # Groups still in flight when training ends were never trained on; leave them pending.
        return await self._summary(before, after, checkpoint)

    async def _start_first_evaluation(self, num_buffered: int) -> Round:
        """The first evaluation, issued once the first step's groups are all in (`_fill` issues one
        step's worth until then), then the rest of the bound. vLLM takes groups in claim order, so the
        first step's tail decodes in small, fast batches instead of beside the evaluation, which then
        runs while the learner trains; the first update waits for its last answer (all from this version)."""
        self.first_due = False
        first = await self.evaluator.start(self.version)
        await self.issuer.issue_train(num_buffered, self.version)  # the rest of the bound
        return first

    async def _timed_step(self, groups: list[common_pb2.TrajectoryGroup], lr: float) -> tuple[dict, float]:
        """One optimizer step on the torch thread (over the parts trained as they arrived, where the
        learner streams); its metrics and when it ended."""
        if self.trainer.streams:
            calls, self.parts, self.part_calls = self.part_calls, [], []
            await asyncio.gather(*calls)
            metrics = await self._torch(self.trainer.finish, lr)
        else:
            metrics = await self._torch(self.trainer.step, self.trainer.objective.sequences(groups), lr)
        return metrics, time.monotonic()

    def _log_step(self, groups, ages, timings: dict, t_last: float) -> None:
        now = time.monotonic()
        record = {"kind": "train", "version": self.version,
                  **groups_record(groups, ages, self.admission.take_flat_rewards())}
        record.update({
            "tokens_per_s": record["num_tokens"] / max(now - t_last, 1e-6), "step_s": now - t_last,
            "max_staleness": self.k, **self.admission.counters(), "in_flight": self.issuer.ledger.in_flight,
            "num_ranks": self.trainer.world_size, **timings,
            # Each rollout server's cumulative engine-busy seconds (for its idle fraction over a span).
            "rollout_busy_s": {g.generator_id: g.busy_seconds for g in self.membership.generators.values()},
        })
        self.metrics.write(record)
        log.info("step %d reward %.3f staleness<=%d mismatch_kl %.2e %.0f tok/s", self.version,
                 record["reward_mean"], record["staleness_max"], record.get("mismatch_kl", 0.0), record["tokens_per_s"])

    async def _summary(self, before: dict | None, after: dict, checkpoint: Path) -> dict:
        from rlmesh.services.weights.wire import weights_digest

        a, first = self.admission, self.evaluator.first or before
        if first is not None and first["version"] != 0:  # learner.eval_at_start=false: no record of the start
            first = None
        algorithm = self.broadcaster.digest_algorithm
        learner_digest = await self._torch(lambda: weights_digest(self.trainer.stream_weights(),
                                                                  self.trainer.weight_metas(), algorithm))
        summary = {
            "run_id": self.run_id, "num_steps": self.version, "max_staleness": self.k, "resumed_from": self.resumed_from,
            "num_ranks": self.trainer.world_size, "weight_transport": self.config.weight_sync.backend,
            "held_out_accuracy_before": first["accuracy"] if first is not None else None,
            "held_out_accuracy_after": after["accuracy"],
            "held_out_accuracy_at_start_of_this_process": before["accuracy"] if before is not None else None,
            "max_staleness_seen": self.max_staleness_seen, "num_dropped_stale": a.num_dropped_stale,
            "num_dropped_other": a.num_dropped_other, "num_dropped_invalid": a.num_dropped_invalid,
            "num_dropped_flat": a.num_dropped_flat, "num_duplicates": a.num_duplicates,
            "num_reissued_after_queue_loss": self.issuer.num_reissued,
            "num_reissued_after_invalid": a.num_reissued_after_invalid,
            "queue_reconnects": self.prompts.num_reconnects + self.trajectories.num_reconnects,
            "weights_sent_versions": len(self.broadcaster.sent_versions),
            "weights_verified_versions": len(self.broadcaster.verified_versions),
            "last_weights_sha256": self.broadcaster.last_digest,
            "learner_weights_sha256": learner_digest,
            "weights_digest_algorithm": algorithm,  # of the two digests above (the keys keep their old names)
            "checkpoint": str(checkpoint),
            "stop_requested": stop_requested(self.run_dir),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
