"""Prompt groups a rollout server rejects, against a real Valkey server: the learner's reader takes
them out of flight and, when every group is rejected, stops the run with the rollout server's reason."""

import uuid

import pytest

from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.reader import TrajectoryReader
from rlmesh.learner.rl.watch import RunStalled, StallWatch
from rlmesh.services.queue import StreamQueue, connect

pytestmark = pytest.mark.integration


class Rows(list):
    def write(self, record):
        self.append(record)


async def test_rejected_groups_leave_flight_and_a_rejection_of_every_group_stops_the_run(valkey_url):
    name = f"test:{uuid.uuid4().hex}"
    prompts = StreamQueue(connect(valkey_url), f"{name}:prompts")
    trajectories = StreamQueue(connect(valkey_url), f"{name}:trajectories")
    for q in (prompts, trajectories):
        await q.ensure_group()
    train = [Example(str(i), [{"role": "user", "content": f"{i}+1="}], "arithmetic", {"answer": str(i + 1)})
             for i in range(10)]
    issuer = PromptIssuer(prompts, "run", train, group_size=4, groups_per_step=2, max_staleness=1)
    rows = Rows()
    watch = StallWatch(rows, failure_limit=4, log_hint="/run/logs/{service}.log")
    reader = TrajectoryReader(prompts, trajectories, run_id="run", issuer=issuer, admission=None, membership=None,
                              metrics=rows, watch=watch)
    await prompts.set_marker("run", "run")
    await issuer.issue_train(num_buffered=0, version=0)
    assert issuer.ledger.in_flight == 4
    # A rollout server rejects two of them (and another run's group, which this run ignores).
    entries = await prompts.read("rollout-0", count=2, block_ms=100)
    for entry in entries:
        await prompts.dead_letter(entry, "VLLMValidationError: the prompt is longer than the context", by="rollout-0")
    await prompts.publish("other-run/train/1/x", b"")
    rest = await prompts.read("rollout-0", count=10, block_ms=100)
    [other] = [e for e in rest if e.key.startswith("other")]
    await prompts.dead_letter(other, "not ours", by="rollout-1")
    await reader._check_rejected()
    assert issuer.ledger.in_flight == 2 and watch.failed_in_a_row == 2
    for entry in rest:
        if entry.key.startswith("run/"):
            await prompts.dead_letter(entry, "VLLMValidationError: the prompt is longer than the context",
                                      by="rollout-0")
    with pytest.raises(RunStalled, match=r"4 prompt groups in a row failed .* rollout server rollout-0: "
                                         r"VLLMValidationError: the prompt is longer .*\(its log: "
                                         r"/run/logs/rollout-0.log\)"):
        await reader._check_rejected()
    assert issuer.ledger.in_flight == 0
    assert rows[-1]["kind"] == "alert" and rows[-1]["level"] == "fatal"
