"""The long-tail reasoning task (examples/data/reasoning_long, made by `scripts/make_reasoning_data.py
--long`, read by examples/reasoning_long_grpo.yaml): files that regenerate identically, worked answers
whose lengths in the tiny model's tokens are long-tailed and fit the config's completion budget, and
answers that are right by construction (recomputed here from the question's words)."""

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.reward_server.environments.math import equivalent, extract_answer, reference_answer
from rlmesh.services.config import load_config

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "examples/data/reasoning_long"
CONFIG = REPO / "examples/reasoning_long_grpo.yaml"
GAINS = {"buys", "finds", "gets"}


def rows(split: str) -> list[dict]:
    return pq.read_table(DATA / f"{split}.parquet").to_pylist()


def test_files_regenerate_identically_as_parquet_only(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts/make_reasoning_data.py"), "--long", "--output", str(tmp_path)],
                   check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]
    for name in ("train.parquet", "test.parquet"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    train, test = {r["question"] for r in rows("train")}, {r["question"] for r in rows("test")}
    assert len(train) == 600 and len(test) == 100 and not train & test


def test_answer_lengths_are_long_tailed_within_the_completion_budget():
    config = load_config(CONFIG)
    tok = build_tokenizer(config.model.tokenizer)
    lengths = sorted(len(tok.encode(r["solution"], add_special_tokens=False)) for r in rows("train"))
    p50, p90, p99 = (lengths[int(q * (len(lengths) - 1))] for q in (0.5, 0.9, 0.99))
    assert lengths[0] >= 60 and lengths[-1] <= config.rollout.max_tokens
    assert p50 <= 150 and p90 >= 3 * p50 and p99 >= 800  # most are short, a few are ~8x longer
    prompts = [len(tok.encode(r["question"], add_special_tokens=False)) for r in rows("train")]
    assert max(prompts) + 100 + config.rollout.max_tokens <= config.rollout.max_model_len  # 100: template


def test_answers_are_right_by_construction():
    for r in rows("train")[:200] + rows("test"):
        start, ops = re.fullmatch(r"\w+ has (\d+) \w+\. Then \w+ (.*)\. How many \w+ are left\?", r["question"]).groups()
        count, steps = int(start), r["solution"].split(". ")
        for phrase, step in zip(ops.split(", "), steps, strict=False):
            verb, by = phrase.split()
            new = count + int(by) if verb in GAINS else count - int(by)
            assert step.removesuffix(".") == f"{phrase}: {count} {'+' if verb in GAINS else '-'} {by} = {new}"
            assert 0 <= new <= 20
            count = new
        assert len(steps) == len(ops.split(", ")) + 1 and steps[-1] == f"\\boxed{{{count}}}"
        assert r["final"] == str(count) and r["answer"].endswith(f"#### {count}")
        wrong, _ = extract_answer(r["rejected"])  # a step short: the count before the last step
        assert not equivalent(str(count), wrong)


def test_the_config_reads_the_task_as_the_math_environment_scores_it():
    config = load_config(CONFIG)
    assert config.rollout.max_tokens == 1024 and config.algorithm.group_size == 8
    train, held_out = load_dataset(config.data, config.run.seed)
    assert len(held_out) == config.data.num_eval == 50  # the first 50 of the 100 held-out problems
    for i in range(20):
        ex = train.at(i)
        assert ex.env == "math" and ex.messages[-1]["content"].endswith("Put the answer in \\boxed{}.")
        answer, where = extract_answer(ex.reference)
        assert where == "boxed" and equivalent(reference_answer(ex.metadata["answer"]), answer)
