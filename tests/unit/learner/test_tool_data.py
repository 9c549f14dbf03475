"""The calculator dataset and its SFT demonstrations: disjoint splits, the `add` tool rendered into
the prompt as the episode will render it, loss on the assistant turns only, and label noise that
skips the tool."""

import random

from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.train.objectives.sft import SFTObjective
from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.services.domain.chat import ChatCodec
from rlmesh.services.config import CalculatorDataSection
from rlmesh.services.domain.tasks import ADD_TOOL


def test_calculator_splits_are_disjoint_and_demonstrate_the_tool():
    train, evals = load_dataset(CalculatorDataSection(num_train=300, num_eval=20), seed=0)
    assert len(train) == 300 and len(evals) == 20
    assert not {e.id for e in train} & {e.id for e in evals}
    ex = evals[0]
    a, b = ex.metadata["a"], ex.metadata["b"]
    assert 100 <= a <= 999 and ex.metadata["answer"] == a + b and ex.env == "calculator" and ex.tools == [ADD_TOOL]
    assert [m["role"] for m in ex.demonstration] == ["user", "assistant", "tool", "assistant"]
    assert ex.demonstration[-1]["content"] == str(a + b) and f'"a": {a}, "b": {b}' in ex.demonstration[1]["content"]


def test_sft_learns_the_assistant_turns_and_noise_skips_the_tool():
    codec = ChatCodec(build_tokenizer("bpe"))
    train, _ = load_dataset(CalculatorDataSection(num_train=50, num_eval=5), seed=1)
    ex = train[0]
    clean = SFTObjective(codec, random.Random(0), label_noise=0.0).sequence(ex)
    text = codec.tokenizer.decode(clean.prompt_ids)
    assert text.startswith("<|im_start|>system\nTools:\nadd(a, b)") and text.endswith("<|im_start|>assistant\n")
    learned = codec.tokenizer.decode([t for t, m in zip(clean.completion_ids, clean.loss_mask) if m])
    assert learned == f"{ex.demonstration[1]['content']}<|im_end|>{ex.metadata['answer']}<|im_end|>"
    noisy = SFTObjective(codec, random.Random(0), label_noise=1.0).sequence(ex)
    assert all(noisy.loss_mask) and "<tool_call>" not in codec.tokenizer.decode(noisy.completion_ids)
    assert codec.tokenizer.decode(noisy.completion_ids) == f"{ex.metadata['a']}<|im_end|>"
