"""Forged entries written straight into the trajectory stream of a live `rlmesh up` run, as anyone
who reaches the queue could: groups this run never issued, groups under a real outstanding id but
malformed in every way the learner checks (lengths, token ids, logprobs, rewards, versions, sample
count), an eval group with no samples, and bytes that are no TrajectoryGroup. Each is dropped with
its reason in dropped_groups.jsonl and acked; none is
trained on; the in-flight bound holds (an unknown id changes no count); the run completes and learns.

A forged copy of a real group id races the rollout server's real one: the test writes its forgeries
the moment the learner issues the ids, and checks the content reason for those it won (most); a
forgery that lost is dropped as "already back" instead."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import redis

from rlmesh.learner.metrics import read_metrics, surviving_lineage
from rlmesh.services.ports import free_port
from rlmesh.v1 import common_pb2
from tests.e2e.test_mesh import Up
from tests.faults.test_faults import _valkey

pytestmark = pytest.mark.security
NUM_STEPS, GROUPS_PER_STEP = 16, 16
PROMPTS, TRAJECTORIES = "rlmesh:prompts", "rlmesh:trajectories"


def _valid(prompt: common_pb2.PromptGroup) -> common_pb2.TrajectoryGroup:
    """A well-formed answer to `prompt` (each case below breaks exactly one thing)."""
    v = prompt.issued_at_version
    samples = [common_pb2.Sample(index=i, completion=common_pb2.TokenSequence(token_ids=[5, 6], loss_mask=[True, True]),
                                 logprobs=[-0.5, -0.7], min_version=v, max_version=v, reward=float(i % 2),
                                 finish_reason="stop") for i in range(prompt.n)]
    return common_pb2.TrajectoryGroup(group_id=prompt.group_id, run_id=prompt.run_id, prompt=prompt,
                                      prompt_token_ids=[1, 2, 3], samples=samples, generator_id="forger")


def _mask_longer(g):
    g.samples[0].completion.loss_mask.extend([True] * 7)  # a mask of 9 over 2 tokens


def _set_token(value):
    return lambda g: g.samples[1].completion.token_ids.__setitem__(0, value)


def _set_logprob(value):
    return lambda g: g.samples[2].logprobs.__setitem__(0, value)


def _set_reward(value):
    return lambda g: setattr(g.samples[3], "reward", value)


def _versions(lo, hi):
    def mutate(g):
        g.samples[0].min_version, g.samples[0].max_version = lo(g), hi(g)
    return mutate


# Malformed copies of real outstanding train groups: case -> (mutation, reason it must be dropped for).
CASES = {
    "mask longer than tokens": (_mask_longer, "2 completion tokens but 9 loss-mask entries"),
    "negative token id": (_set_token(-5), "token id -5 outside the vocabulary"),
    "huge token id": (_set_token(2_000_000_000), "token id 2000000000 outside the vocabulary"),
    "nan logprob": (_set_logprob(math.nan), "logprob nan is not finite"),
    "positive logprob": (_set_logprob(3.0), "logprob 3.0 is not finite and <= 0"),
    "nan reward": (_set_reward(math.nan), "reward nan is not finite"),
    "huge reward": (_set_reward(3e38), "(reward.max_abs_reward)"),
    "too few samples": (lambda g: [g.samples.pop() for _ in range(7)], "1 samples, issued for 8"),
    "foreign run id": (lambda g: setattr(g, "run_id", "someone-else"), "do not match the issued run"),
    "older than issued": (_versions(lambda g: g.prompt.issued_at_version - 1, lambda g: g.prompt.issued_at_version),
                          "not within the group's issue version"),
    "newer than the learner": (_versions(lambda g: g.prompt.issued_at_version, lambda g: 10**6),
                               "newer than the learner"),
}
ALREADY_BACK = "not issued by this run"


class Forger:
    """Watches the prompt stream and answers newly issued groups with forgeries, at once."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.seen: set[str] = set()
        self.forged: dict[str, str] = {}  # group id -> expected reason
        self.cases: dict[str, str] = {}  # group id -> case name
        self.entry_ids: list[str] = []
        self.eval_forged: dict[str, int] = {}  # eval group id -> the round's version
        self.run_id = ""  # the run's id, from the first prompt group seen

    def add(self, key: str, data: bytes) -> None:
        self.entry_ids.append(self.client.xadd(TRAJECTORIES, {"key": key, "data": data}).decode())

    def new_prompts(self) -> list[common_pb2.PromptGroup]:
        fresh = []
        for _, fields in self.client.xrevrange(PROMPTS, count=256):
            key = fields[b"key"].decode()
            if key not in self.seen:
                self.seen.add(key)
                fresh.append(common_pb2.PromptGroup.FromString(fields[b"data"]))
                self.run_id = self.run_id or fresh[-1].run_id
        return fresh

    def skip_issued(self) -> str:
        """Mark every group issued so far as seen (its answer may be back already); the run id once a
        prompt group has been seen ("" before: acked prompts are deleted, so the stream can be empty)."""
        self.new_prompts()
        return self.run_id

    def forge_round(self, prompts: list[common_pb2.PromptGroup]) -> None:
        train = [p for p in prompts if p.split == "train" and p.issued_at_version >= 1]
        for (case, (mutate, reason)), prompt in zip([c for c in CASES.items() if c[0] not in self.done()], train):
            group = _valid(prompt)
            mutate(group)
            self.add(prompt.group_id, group.SerializeToString())
            self.forged[prompt.group_id] = reason
            self.cases[prompt.group_id] = case
        evals = [p for p in prompts if p.split == "eval"]
        if evals and not self.eval_forged:
            empty = _valid(evals[0])
            empty.ClearField("samples")
            self.add(evals[0].group_id, empty.SerializeToString())
            self.eval_forged[evals[0].group_id] = evals[0].issued_at_version

    def done(self) -> set[str]:
        return set(self.cases.values())

    def forge_strangers(self, run_id: str) -> None:
        """Groups no learner issued, and bytes that are no TrajectoryGroup."""
        for gid in (f"{run_id}/train/999999/x", "other-run/train/1/x"):
            prompt = common_pb2.PromptGroup(group_id=gid, run_id=gid.split("/")[0], n=8, split="train",
                                            issued_at_version=1)
            self.add(gid, _valid(prompt).SerializeToString())
            self.forged[gid] = "not issued by this run"
            self.cases[gid] = f"unknown id {gid}"
        self.add("garbage", b"\xff\x00 not a protobuf \xff" * 8)


def test_forged_trajectory_entries_are_dropped_with_reasons_and_the_run_learns(tmp_path):
    port = free_port()
    valkey = _valkey(port, tmp_path / "valkey")
    run_dir = tmp_path / "run"
    up = Up(run_dir, f"learner.num_steps={NUM_STEPS}", f"learner.groups_per_step={GROUPS_PER_STEP}",
            "learner.eval_every=4", "data.num_eval=8", f"queue.url=redis://127.0.0.1:{port}")
    client = redis.Redis(port=port)
    forger = Forger(client)
    try:
        up.wait_for(lambda: client.exists(PROMPTS) and len(_train_rows(run_dir)) >= 1, 900, "the first training step")
        up.wait_for(forger.skip_issued, 300, "a prompt group on the stream")  # forge only for fresh ones
        forger.forge_strangers(forger.run_id)
        deadline = time.monotonic() + 600
        while (len(forger.done()) < len(CASES) + 2 or not forger.eval_forged) and up.proc.poll() is None:
            assert time.monotonic() < deadline, "no fresh prompt groups to forge answers for"
            forger.forge_round(forger.new_prompts())
            time.sleep(0.01)
        code = up.finish(timeout=900)
        assert code == 0, up.output()[-4000:]
        assert not up.leftovers(), f"processes outlived rlmesh up: {up.leftovers()}"

        summary = json.loads((run_dir / "summary.json").read_text())
        train = _train_rows(run_dir)
        dropped = [json.loads(line) for line in (run_dir / "dropped_groups.jsonl").read_text().splitlines()]
        reasons: dict[str, list[str]] = {}
        for row in dropped:
            reasons.setdefault(row["group_id"], []).append(row["reason"])
        lineage = surviving_lineage([json.loads(line) for line in
                                     (run_dir / "trained_groups.jsonl").read_text().splitlines()])
        trained = {g for r in lineage for g in r["group_ids"]}

        # Every forgery is on record with its reason (or, having lost the race, as already back).
        won = 0
        for gid, reason in forger.forged.items():
            got = reasons.get(gid, [])
            assert any(reason in r or ALREADY_BACK in r for r in got), (forger.cases[gid], got)
            if any(reason in r for r in got):
                won += 1
                assert gid not in trained or reason == ALREADY_BACK, f"{forger.cases[gid]}: its id was trained"
        print(f"forged {len(forger.forged)} groups; {won} dropped for their own defect; "
              f"{summary['num_dropped_invalid']} invalid drops in all")
        assert won >= len(forger.forged) // 2, "most forgeries must beat the real answer and show their defect"
        assert any("not a TrajectoryGroup" in r for r in reasons["garbage"]), reasons.get("garbage")
        # Acked: no forged entry is left pending on the learner.
        pending = {p["message_id"].decode() if isinstance(p["message_id"], bytes) else p["message_id"]
                   for p in client.xpending_range(TRAJECTORIES, "learner", "-", "+", 100000)}
        assert not pending & set(forger.entry_ids)
        # The eval round the empty group forged into still finished (a failed answer, not a crash).
        evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]
        (eval_id, eval_version), = forger.eval_forged.items()
        assert eval_version in {r["version"] for r in evals}
        if any("0 samples, issued for 1" in r for r in reasons.get(eval_id, [])):
            assert next(r for r in evals if r["version"] == eval_version)["num_errors"] >= 1

        # The run completed, within its bounds, and learned.
        assert [r["version"] for r in train] == list(range(1, NUM_STEPS + 1))
        assert max(r["in_flight"] for r in train) <= 2 * GROUPS_PER_STEP, "unknown ids must not free in-flight room"
        assert summary["max_staleness_seen"] <= 1
        assert summary["last_weights_sha256"] == summary["learner_weights_sha256"]
        first, last = train[:4], train[-4:]
        reward_first = sum(r["reward_mean"] for r in first) / len(first)
        reward_last = sum(r["reward_mean"] for r in last) / len(last)
        print(f"train reward {reward_first:.3f} -> {reward_last:.3f}")
        assert reward_last > reward_first, f"reward did not rise: {reward_first:.3f} -> {reward_last:.3f}"
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
        valkey.terminate()


def _train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("kind") == "train"] if path.exists() else []
