"""Forged entries written straight into the trajectory stream of a live `rlmesh up` run, as anyone
who reaches the queue could: groups this run never issued, groups under a real outstanding id but
malformed in every way the learner checks (lengths, token ids, logprobs, rewards, versions, sample
count), an eval group with no samples, and bytes that are no TrajectoryGroup. Each is dropped with
its reason in dropped_groups.jsonl and acked; none is trained on; the in-flight bound holds (an
unknown id changes no count); the run completes and learns.

The rule for a copy under a real group id: it is validated whenever it comes, and a malformed one
never costs the real group. The forger writes a malformed copy of each kind the moment the learner
issues an id (most land before the rollout server's real copy: the real group must still be trained,
0 lost), and again for ids already trained (dropped with the same content reason, never trained
twice); a well-formed copy of a trained id is a duplicate.

The forgeries ride on the main mesh test's run (tests/e2e/test_mesh.py): `Forger.run` forges on a
thread of its own while that run trains, and `check` reads the run directory afterwards."""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections import Counter
from pathlib import Path

import redis

from rlmesh.learner.trackers.metrics import read_metrics, surviving_lineage
from rlmesh.v1 import common_pb2

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
                               "..1000000 are not within the group's issue version"),
}
NOT_ISSUED = "not issued by this run"


class Forger:
    """Watches the prompt stream and answers newly issued groups with forgeries, at once."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.seen: dict[str, common_pb2.PromptGroup] = {}  # every prompt group seen, by id
        self.fresh: queue.SimpleQueue[common_pb2.PromptGroup] = queue.SimpleQueue()  # seen, not yet handed out
        self.forged: dict[str, str] = {}  # group id -> expected reason
        self.cases: dict[str, str] = {}  # group id -> case name
        self.first: set[str] = set()  # real group ids forged before the rollout server published its copy
        self.late: set[str] = set()  # real group ids forged after their real copy was trained
        self.entry_ids: list[str] = []
        self.eval_forged: dict[str, int] = {}  # eval group id -> the round's version
        self.run_id = ""  # the run's id, from the first prompt group seen
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.finished = False
        # Prompts live on their stream only until a rollout server has answered them (tens of ms for
        # the tiny model), so polling misses many; a blocking tail from the stream's start sees each.
        self.tail = threading.Thread(target=self._tail, daemon=True)
        self.tail.start()

    def add(self, key: str, data: bytes) -> bool:
        """Append a forged entry; whether the rollout server had published its copy under `key` before
        (its publish marks the key in the stream's published set, atomically with its append)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(TRAJECTORIES, {"key": key, "data": data})
        pipe.sismember(f"{TRAJECTORIES}:published", key)
        entry_id, published = pipe.execute()
        self.entry_ids.append(entry_id.decode())
        return bool(published)

    def _tail(self) -> None:
        client, cursor = redis.Redis(connection_pool=self.client.connection_pool), "0-0"
        while not self.stop.is_set():
            for _, entries in client.xread({PROMPTS: cursor}, block=100) or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    prompt = common_pb2.PromptGroup.FromString(fields[b"data"])
                    self.seen[prompt.group_id] = prompt
                    self.run_id = self.run_id or prompt.run_id
                    self.fresh.put(prompt)

    def new_prompts(self) -> list[common_pb2.PromptGroup]:
        """Prompt groups issued since the last call."""
        fresh = []
        while not self.fresh.empty():
            fresh.append(self.fresh.get())
        return fresh

    def skip_issued(self) -> str:
        """Hand out nothing issued so far (its answer may be back already); the run id once a prompt
        group has been seen ("" before)."""
        self.new_prompts()
        return self.run_id

    def forge_round(self, prompts: list[common_pb2.PromptGroup]) -> None:
        train = [p for p in prompts if p.split == "train" and p.issued_at_version >= 1]
        for (case, (mutate, reason)), prompt in zip([c for c in CASES.items() if c[0] not in self.done()], train):
            if not self.forge(prompt, case, mutate, reason):
                self.first.add(prompt.group_id)
        evals = [p for p in prompts if p.split == "eval"]
        if evals and not self.eval_forged:
            empty = _valid(evals[0])
            empty.ClearField("samples")
            self.add(evals[0].group_id, empty.SerializeToString())
            self.eval_forged[evals[0].group_id] = evals[0].issued_at_version

    def forge(self, prompt: common_pb2.PromptGroup, case: str, mutate, reason: str) -> bool:
        """Append a copy of `prompt`'s answer broken by `mutate`; whether the real copy came first."""
        group = _valid(prompt)
        mutate(group)
        self.forged[prompt.group_id], self.cases[prompt.group_id] = reason, case
        return self.add(prompt.group_id, group.SerializeToString())

    def forge_late(self, trained: set[str]) -> bool:
        """Each malformed case again, under ids whose real copy was trained, and one well-formed copy
        of a trained id; False until enough trained ids are known."""
        ids = sorted(gid for gid in trained - set(self.forged) if gid in self.seen)
        if len(ids) < len(CASES) + 1:
            return False
        for (case, (mutate, reason)), gid in zip(CASES.items(), ids):
            self.forge(self.seen[gid], f"{case} (after the real copy was trained)", mutate, reason)
            self.late.add(gid)
        self.add(ids[-1], _valid(self.seen[ids[-1]]).SerializeToString())  # a duplicate, never trained twice
        return True

    def run(self, up, run_dir: Path) -> None:
        """Forge through a live run (on a thread of its own): strangers and malformed copies of fresh
        groups once training has begun, an empty eval group, then copies of trained groups. Whatever
        goes wrong is kept in `error` for the test's thread to raise."""
        try:
            self._run(up, run_dir)
        except BaseException as err:  # noqa: BLE001  (re-raised by `check`)
            self.error = err

    def _run(self, up, run_dir: Path) -> None:
        deadline = time.monotonic() + 400

        def wait(predicate, what: str) -> None:
            while not predicate():
                assert up.proc.poll() is None, f"the run ended before {what}"
                assert time.monotonic() < deadline, f"forger: timed out waiting for {what}"
                time.sleep(0.05)

        wait(lambda: self.client.exists(PROMPTS) and len(_train_rows(run_dir)) >= 1, "the first training step")
        wait(self.skip_issued, "a prompt group on the stream")  # forge only for fresh ones
        self.forge_strangers(self.run_id)
        while len(self.done()) < len(CASES) + 2 or not self.eval_forged:
            assert up.proc.poll() is None, "the run ended before every case was forged"
            assert time.monotonic() < deadline, "no fresh prompt groups to forge answers for"
            self.forge_round(self.new_prompts())
            time.sleep(0.01)
        wait(lambda: self.forge_late(_trained_ids(run_dir)), "trained groups to forge copies of")
        self.finished = True

    def close(self) -> None:
        self.stop.set()
        self.tail.join(timeout=5)

    def done(self) -> set[str]:
        return set(self.cases.values())

    def forge_strangers(self, run_id: str) -> None:
        """Groups no learner issued, and bytes that are no TrajectoryGroup."""
        for gid in (f"{run_id}/train/999999/x", "other-run/train/1/x"):
            prompt = common_pb2.PromptGroup(group_id=gid, run_id=gid.split("/")[0], n=8, split="train",
                                            issued_at_version=1)
            self.add(gid, _valid(prompt).SerializeToString())
            self.forged[gid] = NOT_ISSUED
            self.cases[gid] = f"unknown id {gid}"
        self.add("garbage", b"\xff\x00 not a protobuf \xff" * 8)

def check(forger: Forger, run_dir: Path, groups_per_step: int) -> None:
    """After the run: every forgery dropped with its own reason, nothing lost or trained twice, the
    forged entries acked, the forged eval round finished, the in-flight bound kept."""
    if forger.error is not None:
        raise forger.error
    assert forger.finished, "the forger did not get through every case"
    summary = json.loads((run_dir / "summary.json").read_text())
    train = _train_rows(run_dir)
    dropped = [json.loads(line) for line in (run_dir / "dropped_groups.jsonl").read_text().splitlines()]
    reasons: dict[str, list[str]] = {}
    for row in dropped:
        reasons.setdefault(row["group_id"], []).append(row["reason"])
    lineage = surviving_lineage([json.loads(line) for line in
                                 (run_dir / "trained_groups.jsonl").read_text().splitlines()])
    trained = Counter(g for r in lineage for g in r["group_ids"])

    # Every forgery reached validation and is on record with its own defect, whether it came before
    # or after the real copy; none under a real id is mistaken for a stranger's.
    for gid, reason in forger.forged.items():
        got = reasons.get(gid, [])
        assert any(reason in r for r in got), (forger.cases[gid], got)
        assert reason == NOT_ISSUED or not any(NOT_ISSUED in r for r in got), (forger.cases[gid], got)
    # A malformed copy first never cost the real group: the rollout server's copy was trained (or
    # judged on its own, e.g. too stale); nothing was issued again, and no id was trained twice.
    assert forger.first, "no forgery landed before its real copy"
    lost = [forger.cases[gid] for gid in forger.first
            if gid not in trained and not any(not row.get("invalid") for row in dropped if row["group_id"] == gid)]
    assert not lost, f"real groups lost to a malformed copy: {lost}"
    assert summary["num_reissued_after_invalid"] == 0
    assert max(trained.values()) == 1, [g for g, n in trained.items() if n > 1]
    assert forger.late <= set(trained) and summary["num_duplicates"] >= 1
    print(f"forged {len(forger.forged)} groups ({len(forger.first)} before their real copy, "
          f"{len(forger.late)} after it was trained); {len(forger.first & set(trained))} of the first trained; "
          f"{summary['num_dropped_invalid']} invalid drops in all")
    assert any("not a TrajectoryGroup" in r for r in reasons["garbage"]), reasons.get("garbage")
    # Acked: no forged entry is left pending on the learner.
    pending = {p["message_id"].decode() if isinstance(p["message_id"], bytes) else p["message_id"]
               for p in forger.client.xpending_range(TRAJECTORIES, "learner", "-", "+", 100000)}
    assert not pending & set(forger.entry_ids)
    # The eval round the empty group forged into still finished (a failed answer, not a crash).
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]
    (eval_id, eval_version), = forger.eval_forged.items()
    assert eval_version in {r["version"] for r in evals}
    if any("0 samples, issued for 1" in r for r in reasons.get(eval_id, [])):
        assert next(r for r in evals if r["version"] == eval_version)["num_errors"] >= 1
    # Unknown ids opened no in-flight room past the staleness bound.
    assert max(r["in_flight"] for r in train) <= 2 * groups_per_step, "unknown ids must not free in-flight room"


def _train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("kind") == "train"] if path.exists() else []


def _trained_ids(run_dir: Path) -> set[str]:
    path = run_dir / "trained_groups.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {gid for row in rows for gid in row.get("group_ids", [])}
