"""`data.type: hf` on the shipped GSM8K-format sample (examples/data/gsm8k_sample, made by
scripts/make_gsm8k_sample.py) and on small files written here: every source kind, the field
mapping, per-epoch shuffling and a cursor that resumes exactly, in memory and streamed."""

import json
import random
from pathlib import Path

import pytest

from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.data.examples import TrainOrder
from rlmesh.learner.data.hf import StreamOrder
from rlmesh.services.config import load_config

SAMPLE = Path(__file__).resolve().parents[3] / "examples/data/gsm8k_sample"


def _data(*overrides: str):
    return load_config(None, ["data.type=hf", *overrides]).data


def _gsm8k(suffix: str, *overrides: str):
    return _data(f"data.path={SAMPLE}/train.{suffix}", f"data.eval_path={SAMPLE}/test.{suffix}",
                 "data.prompt_key=question", *overrides)


def test_sample_files_are_gsm8k_format_and_regenerate_identically(tmp_path):
    import subprocess
    import sys

    rows = [json.loads(line) for line in (SAMPLE / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 400 and all(set(r) == {"question", "answer"} for r in rows)
    assert all(r["answer"].rsplit("\n", 1)[-1].startswith("#### ") for r in rows)
    subprocess.run([sys.executable, str(SAMPLE.parents[2] / "scripts/make_gsm8k_sample.py"), "--output", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("train.jsonl", "test.jsonl", "train.parquet", "test.parquet"):
        assert (tmp_path / name).read_bytes() == (SAMPLE / name).read_bytes(), name


def test_parquet_and_jsonl_map_to_the_same_examples():
    template = "{prompt} Put the final answer after ####."
    pq_train, pq_eval = load_dataset(_gsm8k("parquet", "data.system_prompt=Think step by step.",
                                            f"data.prompt_template='{template}'", "data.shuffle=false"), 0)
    js_train, js_eval = load_dataset(_gsm8k("jsonl", "data.system_prompt=Think step by step.",
                                            f"data.prompt_template='{template}'", "data.shuffle=false"), 0)
    assert isinstance(pq_train, TrainOrder) and len(pq_train) == 400 and len(pq_eval) == 100
    assert list(pq_train) == list(js_train) and pq_eval == js_eval
    row = json.loads((SAMPLE / "train.jsonl").read_text().splitlines()[0])
    ex = pq_train.at(0)
    assert ex.id == "train-0" and ex.env == "math"
    assert ex.messages == [{"role": "system", "content": "Think step by step."},
                           {"role": "user", "content": f"{row['question']} Put the final answer after ####."}]
    # The worked solution is the environment's reference answer and SFT's target.
    assert ex.metadata == {"answer": row["answer"]} and ex.reference == row["answer"]
    assert pq_eval[0].id == "test-0"
    _, few = load_dataset(_gsm8k("parquet", "data.num_eval=7", "data.num_train=50"), 0)
    assert len(few) == 7


def test_messages_metadata_columns_and_preference_pairs(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = [{"uid": f"u{i}", "messages": [{"role": "user", "content": f"{i}+1="}], "level": i % 3, "source": "toy",
             "answer": str(i + 1), "chosen": str(i + 1),
             "rejected": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i)}]}
            for i in range(12)]
    DatasetDict({"train": Dataset.from_list(rows[:8]), "validation": Dataset.from_list(rows[8:])}).save_to_disk(
        str(tmp_path / "saved"))
    cfg = _data(f"data.path={tmp_path / 'saved'}", "data.eval_split=validation", "data.metadata_keys=[level]",
                "data.id_key=uid", "data.env_name=arithmetic", "data.shuffle=false")
    train, evals = load_dataset(cfg, 0)
    assert len(train) == 8 and [e.id for e in evals] == ["u8", "u9", "u10", "u11"]
    ex = train.at(3)
    assert ex.messages == [{"role": "user", "content": "3+1="}] and ex.env == "arithmetic"
    assert ex.metadata == {"level": 0, "answer": "4"} and (ex.chosen, ex.rejected) == ("4", "3")
    # Without metadata_keys every column but the prompt and the pair reaches the environment.
    train, _ = load_dataset(_data(f"data.path={tmp_path / 'saved'}", "data.eval_split=validation"), 0)
    assert set(train[0].metadata) == {"uid", "level", "source", "answer"}
    # TRL's conversational form: the prompt column holds the messages.
    Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}]).to_json(tmp_path / "trl.jsonl")
    train, _ = load_dataset(_data(f"data.path={tmp_path / 'trl.jsonl'}", f"data.eval_path={tmp_path / 'trl.jsonl'}"), 0)
    assert train[0].messages == [{"role": "user", "content": "1+1="}] and train[0].metadata == {"answer": "2"}
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ValueError, match="holds one split: give the held-out rows in data.eval_path"):
        load_dataset(_data(f"data.path={tmp_path / 'one'}"), 0)
    train, evals = load_dataset(_data(f"data.path={tmp_path / 'one'}", f"data.eval_path={tmp_path / 'saved'}",
                                      "data.eval_split=validation"), 0)
    assert len(train) == 12 and len(evals) == 4
    with pytest.raises(ValueError, match="no split 'test'; it has train, validation"):
        load_dataset(_data(f"data.path={tmp_path / 'saved'}"), 0)
    with pytest.raises(ValueError, match=r"metadata_keys names column\(s\) grade"):
        load_dataset(_data(f"data.path={tmp_path / 'saved'}", "data.eval_split=validation",
                           "data.metadata_keys=[grade]"), 0)


def test_mapping_errors_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="holds one split: give the held-out rows in data.eval_path"):
        load_dataset(_data(f"data.path={SAMPLE}/train.parquet"), 0)
    with pytest.raises(ValueError, match="has neither 'messages' .* nor 'prompt' .*columns: question, answer"):
        load_dataset(_gsm8k("jsonl", "data.prompt_key=prompt"), 0)
    with pytest.raises(ValueError, match="matches no data file"):
        load_dataset(_data(f"data.path={tmp_path}/none-*.parquet", f"data.eval_path={SAMPLE}/test.parquet"), 0)


def test_every_epoch_is_a_new_seeded_permutation_and_a_cursor_resumes_it():
    train, _ = load_dataset(_gsm8k("parquet"), 0)
    order = [train.at(c).id for c in range(1200)]
    epochs = [order[i:i + 400] for i in (0, 400, 800)]
    assert all(sorted(e) == sorted(f"train-{i}" for i in range(400)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0][:20] != [f"train-{i}" for i in range(20)]
    resumed, _ = load_dataset(_gsm8k("parquet"), 0)  # a restarted learner: the checkpoint's cursor alone
    assert [resumed.at(c).id for c in range(650, 900)] == order[650:900]
    other_seed, _ = load_dataset(_gsm8k("parquet"), 1)
    assert [other_seed.at(c).id for c in range(400)] != epochs[0]


def test_streaming_reads_epochs_in_a_seeded_order_and_resumes_from_a_cursor():
    cfg = _gsm8k("jsonl", "data.streaming=true", "data.shuffle_buffer=64", "data.num_eval=5")
    train, evals = load_dataset(cfg, 0)
    assert isinstance(train, StreamOrder) and len(evals) == 5
    order = [train.at(c).id for c in range(880)]
    assert train.length == 400
    assert sorted(order[:400]) == sorted(f"train-{i}" for i in range(400)) and order[:400] != order[400:800]
    resumed, _ = load_dataset(cfg, 0)
    assert [resumed.at(c).id for c in range(830, 880)] == order[830:880]  # skips to the third epoch
    assert resumed.at(10).id == order[10]  # and back
    in_memory, _ = load_dataset(_gsm8k("jsonl", "data.shuffle=false"), 0)
    by_id = {ex.id: ex for ex in in_memory}
    assert all(train.at(c) == by_id[order[c]] for c in range(0, 400, 37))
    assert [ex.id for ex in train.draw(random.Random(0), 3)] == order[:3]  # SFT reads a stream in order


def test_rlmesh_dpo_needs_the_pairs_in_memory(tmp_path):
    from rlmesh.learner.recipes.dpo import run_dpo

    config = load_config(None, ["data.type=hf", f"data.path={SAMPLE}/train.jsonl", f"data.eval_path={SAMPLE}/test.jsonl",
                                "data.prompt_key=question", "data.streaming=true", "dpo.num_steps=1"])
    with pytest.raises(ValueError, match="set data.streaming=false"):
        run_dpo(config, tmp_path / "never-written")
    assert not (tmp_path / "never-written").exists()  # refused before any output is made


def test_a_data_file_that_is_not_json_lines_is_refused_naming_the_file_and_where(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2", "answer": \n')
    # datasets' own message here is "An error occurred while generating the dataset"
    with pytest.raises(ValueError, match=r"cannot read '.*train.jsonl' as .jsonl \(ArrowInvalid: JSON parse error"):
        load_dataset(_data(f"data.path={bad}", f"data.eval_path={SAMPLE}/test.jsonl", "data.prompt_key=question"), 0)
    lines = tmp_path / "rows.jsonl"
    lines.write_text('{"prompt": "1+1", "metadata": {"answer": "2"}}\nnot json\n')
    config = load_config(None, ["data.type=jsonl", f"data.train_path={lines}", f"data.eval_path={lines}"]).data
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not JSON \(Expecting value at column 1\)"):
        load_dataset(config, 0)


def test_an_answer_key_naming_a_column_the_rows_lack_is_refused_not_dropped():
    """A typo in data.answer_key would leave every reward without its answer, silently."""
    with pytest.raises(ValueError, match=r"row 0: data.answer_key='finall' names a column it does not have; its "
                                         r"columns: question, answer"):
        load_dataset(_gsm8k("jsonl", "data.answer_key=finall"), 0)
    train, _ = load_dataset(_gsm8k("jsonl"), 0)  # the default key ("answer") is taken where it is there
    assert next(iter(train)).metadata["answer"].rsplit("#### ", 1)[1].strip().isdigit()
