"""Controller pieces that need no servers: the builder's config check, admitting held-back groups,
the first step's prompts, training groups as they arrive, on a controller given its components
(fakes for the queues, logs and trainer)."""

import asyncio
from dataclasses import fields
from types import SimpleNamespace

import pytest

from rlmesh.learner.rl.admission import Admission
from rlmesh.learner.rl.controller import Components, Controller
from rlmesh.learner.rl.evaluator import Evaluator
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.validation import Bounds
from rlmesh.v1 import common_pb2
from rlmesh.services.config import load_config
from rlmesh.services.queue import Entry


def components(**given) -> Components:
    """The parts a test hands the controller; the rest are None (the test must not reach them), but
    for a trainer that trains each step at once where none is given."""
    given.setdefault("trainer", SimpleNamespace(streams=False))
    return Components(**{f.name: given.get(f.name) for f in fields(Components)})


async def test_the_builder_refuses_a_model_it_cannot_load(tmp_path):
    from rlmesh.learner.rl.server import build_controller

    with pytest.raises(ValueError, match="model.type=hf"):
        await build_controller(load_config(None, []), tmp_path, 0)


class Acked:  # the trajectory stream: what was acked
    def __init__(self):
        self.acked = []

    async def ack(self, *ids):
        self.acked.extend(ids)
        return len(ids)


class Log:
    def write(self, record):
        pass


class AllIssued:  # the ledger, with every arriving group counted as this run's
    def __init__(self, ledger):
        self.ledger = ledger

    def issued(self, group):
        return common_pb2.PromptGroup(split=group.prompt.split, n=len(group.samples))

    def issued_before_restart(self, group_id):
        return False

    def returned(self, group_id):
        self.ledger.returned(group_id)


def arrival(i: int, version: int, split: str = "train"):
    """A trajectory group as the reader delivers it, rewards 0 and 1 (a signal)."""
    group = common_pb2.TrajectoryGroup(group_id=f"g{i}", prompt=common_pb2.PromptGroup(group_id=f"g{i}", split=split),
                                       prompt_token_ids=[1], samples=[
        common_pb2.Sample(index=j, min_version=version, max_version=version, reward=float(j % 2)) for j in range(4)])
    return Entry(id=f"e{i}", key=f"g{i}", data=b""), group


async def test_groups_held_back_during_an_evaluation_are_admitted_even_when_a_batch_is_already_buffered(tmp_path):
    """They were lost before: with a full batch already buffered (k >= 2), _fill returned at once and
    dropped them, so they were never trained nor acked and counted as in flight forever."""
    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=2",
                                "learner.groups_per_step=4"])
    trajectories = Acked()
    issuer = PromptIssuer(Acked(), "run", [], group_size=4, groups_per_step=4, max_staleness=2)
    admission = Admission(trajectories, Log(), max_staleness=2, drop_zero_advantage_groups=False,
                          ledger=AllIssued(issuer.ledger),
                          bounds=Bounds(vocab_size=10, max_abs_reward=1e4, max_seq_len=64))
    evaluator = Evaluator([], issuer, trajectories, metrics=Log(), check=lambda group, version: "")
    controller = Controller(config, tmp_path, components(run_id="run", trajectories=trajectories, issuer=issuer,
                                                         admission=admission, evaluator=evaluator))
    controller.version = 10
    ready = [arrival(i, 9) for i in range(6)]
    controller.held_back = [arrival(i, 10) for i in range(6, 9)] + [arrival(9, 10, "eval")]
    out = await controller._fill(list(ready))
    assert sorted(g.group_id for _, g in out) == [f"g{i}" for i in range(9)]
    assert controller.held_back == [] and trajectories.acked == ["e9"]


async def test_the_first_evaluation_goes_out_once_the_first_steps_groups_are_in(tmp_path):
    """The first step's groups go out alone: vLLM takes groups in claim order (rollout.max_num_seqs),
    and an evaluation or the rest of the bound issued beside them took every slot their finished
    samples freed, so their tail decoded slowly and the learner waited on it. Once they are all in,
    the evaluation goes out, then the rest of the bound (which the first weight update is not behind).
    After a resume the groups held back count against the bound first."""
    from rlmesh.learner.data.examples import Example

    class Stream:  # the prompt stream, in the order groups were published
        def __init__(self):
            self.keys = []

        async def publish(self, key, data):
            self.keys.append(key)

        async def publish_many(self, records):
            self.keys.extend(key for key, _ in records)

    def examples(split, n):
        return [Example(id=f"{split}{i}", messages=[{"role": "user", "content": "2+2"}], env="math",
                        metadata={"answer": "4"}) for i in range(n)]

    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=1",
                                "learner.groups_per_step=3"])
    for held_back, before, after in (([], ["train"] * 3, ["eval"] * 5 + ["train"] * 3),
                                     ([arrival(i, 0) for i in range(3)], [], ["eval"] * 5 + ["train"] * 3)):
        stream = Stream()
        issuer = PromptIssuer(stream, "run", examples("t", 20), group_size=4, groups_per_step=3, max_staleness=1)
        admission = Admission(Acked(), Log(), max_staleness=1, drop_zero_advantage_groups=False,
                              ledger=AllIssued(issuer.ledger),
                              bounds=Bounds(vocab_size=10, max_abs_reward=1e4, max_seq_len=64))
        evaluator = Evaluator(examples("e", 5), issuer, Acked(), metrics=Log(), check=lambda group, version: "")
        controller = Controller(config, tmp_path, components(run_id="run", issuer=issuer, evaluator=evaluator,
                                                             admission=admission, trajectories=Acked()))
        controller.held_back, controller.first_due = list(held_back), True
        issued_at_read = []

        async def read(version):  # the issued train groups come back one per read
            issued_at_read.append(list(stream.keys))
            key = [k for k in stream.keys if "/train/" in k][len(issued_at_read) - 1]
            entry, group = arrival(len(issued_at_read), version)
            group.group_id = group.prompt.group_id = key
            return [(entry, group)]

        controller._read = read
        ready = await controller._fill([])
        assert len(ready) == 3
        assert all(len(keys) == len(before) for keys in issued_at_read)  # not the bound: one step's worth
        assert [key.split("/")[1] for key in stream.keys] == before
        await controller._start_first_evaluation(len(ready))
        assert [key.split("/")[1] for key in stream.keys] == before + after
        assert issuer.ledger.in_flight == 3 and not controller.first_due  # the bound, (k + 1) * B, less the batch


async def test_groups_train_as_they_are_admitted(tmp_path):
    """learner.train_on_arrival: what each read admits goes to the torch thread to train at once (up to
    groups_per_step in all), while the batch is still filling; the step then waits for those parts and
    takes the optimizer step over them; groups beyond the batch wait for the next step."""
    calls = []

    class Trainer:
        streams = True
        objective = SimpleNamespace(sequences=lambda groups: [g.group_id for g in groups])

        def accumulate(self, seqs):
            calls.append(("accumulate", seqs))

        def finish(self, lr):
            calls.append(("finish", lr))
            return {}

    async def run_torch(fn, *args):
        return fn(*args)

    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=1",
                                "learner.groups_per_step=4"])
    trajectories = Acked()
    issuer = PromptIssuer(Acked(), "run", [], group_size=4, groups_per_step=4, max_staleness=1)

    async def issue_nothing(*args, **kwargs):
        pass

    issuer.issue_train = issue_nothing
    admission = Admission(trajectories, Log(), max_staleness=1, drop_zero_advantage_groups=True,
                          ledger=AllIssued(issuer.ledger),
                          bounds=Bounds(vocab_size=10, max_abs_reward=1e4, max_seq_len=64))
    controller = Controller(config, tmp_path, components(run_id="run", trajectories=trajectories, issuer=issuer,
                                                         admission=admission, trainer=Trainer(), run_torch=run_torch))
    controller.version = 3
    flat = arrival(9, 3)
    for s in flat[1].samples:
        s.reward = 1.0  # no signal: dropped, never trained
    reads = [[arrival(1, 3), flat], [arrival(2, 2)], [arrival(3, 3), arrival(4, 3), arrival(5, 3)]]
    seen_at_read = []

    async def read(version):
        await asyncio.sleep(0)  # the torch calls sent so far run
        seen_at_read.append(list(calls))
        return reads.pop(0)

    controller._read = read
    ready = await controller._fill([(Entry(id="e0", key="g0", data=b""), arrival(0, 2)[1])])
    assert [g.group_id for _, g in ready] == ["g0", "g1", "g2", "g3", "g4", "g5"]
    # The leftover trained before the first read, each read's admissions before the next read: the
    # batch was still filling.
    g0, g1, g2 = ("accumulate", ["g0"]), ("accumulate", ["g1"]), ("accumulate", ["g2"])
    assert seen_at_read == [[g0], [g0, g1], [g0, g1, g2]]
    metrics, _ = await controller._timed_step([g for _, g in ready[:4]], 0.5)
    assert calls == [("accumulate", ["g0"]), ("accumulate", ["g1"]), ("accumulate", ["g2"]),
                     ("accumulate", ["g3"]), ("finish", 0.5)]
    assert controller.parts == [] and controller.part_calls == []
