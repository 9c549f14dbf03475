"""The main demo's data (examples/data/reasoning, made by scripts/make_reasoning_data.py) as the
demo config reads it: files that regenerate identically, worked solutions the `math` environment
scores 1 and `rejected` ones (a step short) it scores 0, and SFT label noise that imitates the
rejected solution instead of the reference."""

import json
import random
import subprocess
import sys
from pathlib import Path

from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.train.objectives.sft import sft_target
from rlmesh.reward_server.environments.math import equivalent, extract_answer, reference_answer
from rlmesh.services.config import load_config

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "examples/data/reasoning"


def test_files_regenerate_identically(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts/make_reasoning_data.py"), "--output", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("train.jsonl", "test.jsonl", "train.parquet", "test.parquet"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    train = {json.loads(line)["question"] for line in (DATA / "train.jsonl").read_text().splitlines()}
    test = {json.loads(line)["question"] for line in (DATA / "test.jsonl").read_text().splitlines()}
    assert len(train) == 2000 and len(test) == 100 and not train & test


def test_solutions_score_1_and_rejected_ones_0_under_the_demo_mapping():
    config = load_config(REPO / "examples/reasoning_grpo.yaml")
    train, held_out = load_dataset(config.data, config.run.seed)
    assert len(held_out) == 100
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    for i in range(40):
        ex = train.at(i)
        row = next(r for r in rows if r["question"] in ex.messages[-1]["content"])
        assert ex.env == "math" and ex.messages[-1]["content"].endswith("Put the answer in \\boxed{}.")
        gold = reference_answer(ex.metadata["answer"])
        assert gold == row["answer"].rsplit("#### ", 1)[1] == row["final"]  # GSM8K's answer is the boxed one
        # At least ~30 tokens of working (the tiny model's tokenizer is a token a byte) before the box.
        assert len(ex.reference.split("\\boxed")[0]) >= 30
        answer, where = extract_answer(ex.reference)
        assert where == "boxed" and equivalent(gold, answer)
        wrong, _ = extract_answer(ex.rejected)
        assert not equivalent(gold, wrong), ex.rejected


def test_label_noise_imitates_the_rejected_solution():
    config = load_config(REPO / "examples/reasoning_grpo.yaml")
    train, _ = load_dataset(config.data, 0)
    ex = train.at(0)
    assert sft_target(ex, random.Random(0), 0.0) == ex.reference
    assert sft_target(ex, random.Random(0), 1.0) == ex.rejected != ex.reference
    rng = random.Random(0)
    noisy = sum(sft_target(ex, rng, 0.6) == ex.rejected for _ in range(1000))
    assert 550 < noisy < 650
