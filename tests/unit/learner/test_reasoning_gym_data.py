"""`data.type: reasoning_gym` with real reasoning-gym generators: seeded, held-out and training
questions distinct and disjoint on a generator that repeats itself, the prompt in reasoning-gym's
convention, the entry surviving the protobuf Struct intact, and user mistakes named."""

import json

import pytest
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.data.sources import load_dataset
from rlmesh.services.config import ReasoningGymDataSection, validate_config
from rlmesh.services.config.run_config import ConfigError

# 121 distinct questions ("Calculate 3 + 4."); the first 100 draws hold only 69 of them.
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_parentheses": False, "allow_negation": False}


def _cfg(**kw) -> ReasoningGymDataSection:
    return ReasoningGymDataSection(**{"dataset": "basic_arithmetic", "settings": SMALL, "num_train": 60,
                                      "num_eval": 20, **kw})


def _questions(examples) -> list[str]:
    return [json.loads(e.metadata["entry"])["question"] for e in examples]


def test_split_is_distinct_disjoint_and_seeded():
    import reasoning_gym

    drawn = [reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=80, **SMALL)[i]["question"] for i in range(80)]
    assert len(set(drawn)) < 80, "the generator repeats itself, so the split has something to remove"
    train, evals = load_dataset(_cfg(), seed=0)
    train, held_out = _questions(train.examples), _questions(evals)
    assert (len(train), len(held_out)) == (60, 20)
    assert len(set(train)) == 60 and len(set(held_out)) == 20, "no question twice within a set"
    assert not set(train) & set(held_out), "no held-out question is trained on"
    again, _ = load_dataset(_cfg(), seed=0)
    assert _questions(again.examples) == train, "same seed, same data"
    other, _ = load_dataset(_cfg(), seed=1)
    assert _questions(other.examples) != train
    fixed, _ = load_dataset(_cfg(seed=0), seed=1)
    assert _questions(fixed.examples) == train, "data.seed overrides run.seed"
    _, more_train = load_dataset(_cfg(num_train=80), seed=0)
    assert _questions(more_train) == held_out, "the held-out set does not move with num_train"


def test_a_generator_without_enough_distinct_questions_is_refused():
    with pytest.raises(ValueError, match=r"gave \d+ distinct questions in 520 draws, fewer than .* = 130"):
        load_dataset(_cfg(num_train=110), seed=0)


def test_prompt_follows_reasoning_gyms_convention_and_metadata_survives_a_struct():
    train, _ = load_dataset(_cfg(num_train=1, num_eval=1, prompt_template="{question} Think briefly."), seed=0)
    example = train.at(0)
    system, user = example.messages
    assert system["role"] == "system" and "<answer>answer here</answer>" in system["content"]
    assert user["content"].startswith("Calculate ") and user["content"].endswith(". Think briefly.")
    assert example.env == "reasoning_gym" and example.metadata["dataset"] == "basic_arithmetic"
    struct = Struct()
    struct.update(example.metadata)
    entry = json.loads(MessageToDict(struct)["entry"])
    assert entry["answer"] == example.metadata["answer"] == example.reference
    assert isinstance(entry["metadata"]["num_terms"], int), "integers stay integers through the Struct"
    bare, _ = load_dataset(_cfg(num_train=1, num_eval=1, system_prompt=None), seed=0)
    assert [m["role"] for m in bare.at(0).messages] == ["user"]


def test_solved_examples_come_before_each_question_and_are_in_neither_split():
    train, evals = load_dataset(_cfg(num_shots=2), seed=0)
    messages = train.at(0).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert all(e.messages[:5] == messages[:5] for e in [*train.examples, *evals]), "the same shots everywhere"
    assert messages[2]["content"].startswith("<answer>") and messages[2]["content"].endswith("</answer>")
    shown = {messages[1]["content"], messages[3]["content"]}
    assert not shown & set(_questions([*train.examples, *evals]))
    _, no_shots = load_dataset(_cfg(), seed=0)
    assert shown == set(_questions(no_shots[:2])), "the shots are the first distinct questions"


@pytest.mark.parametrize("overrides, error", [
    ({"dataset": "no_such_task"}, "data.dataset='no_such_task' is not a reasoning-gym dataset; choices: .*leg_counting"),
    ({"settings": {"max_digitz": 1}}, r"data.settings=.*rejected by reasoning-gym's 'basic_arithmetic' config: TypeError"),
    ({"settings": {"min_terms": 5, "max_terms": 2}}, "rejected by reasoning-gym's 'basic_arithmetic' config: AssertionError"),
    ({"system_prompt": "chatty"}, "data.system_prompt='chatty' is not one of reasoning-gym's prompts"),
])
def test_user_mistakes_name_the_field(overrides, error):
    with pytest.raises(ValueError, match=error):
        load_dataset(_cfg(**overrides), seed=0)


@pytest.mark.parametrize("data, error", [
    ({"settings": {"seed": 3}}, "data.settings sets seed; use data.seed"),
    ({"prompt_template": "Solve it."}, "has no {question}"),
])
def test_config_rules(data, error):
    with pytest.raises(ConfigError, match=error):
        validate_config({"data": {"type": "reasoning_gym", "dataset": "basic_arithmetic", **data}})
